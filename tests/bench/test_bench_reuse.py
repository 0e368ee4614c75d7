"""`ft bench reuse` on the tiny MoE shape (CPU): every row present, and reuse computes only the new turn."""

from __future__ import annotations

from freetoken.bench.reuse import main


def test_reuse_bench_writes_every_row(tmp_path, capsys):
    out = tmp_path / "reuse.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--history", "96", "--turn", "8",
            "--edits", "16,48,500", "--repeats", "1", "--expert-cache", "64KiB", "--out", str(out)]
    assert main(argv) == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| case")
            and not line.startswith("| ---")]
    assert [r.split(" | ")[0] for r in rows] == ["| cold", "| reuse", "| reuse, copy only", "| reuse, cpu only",
                                                 "| edit at -16", "| edit at -48"]
    computed = [int(r.split(" | ")[2]) for r in rows]
    assert computed == [104, 8, 8, 8, 24, 56]  # the edit past the history's start (500) is skipped
    cpu_experts = [float(r.split(" | ")[7].strip(" |")) for r in rows]
    assert cpu_experts[2] == 0 < cpu_experts[3]  # copy only computes nothing on the CPU, cpu only does
    assert "history 96 tokens" in table and "ft bench reuse" in table
    assert "expert hit rate | GB copied | CPU experts" in table  # offloaded: each row shows its expert traffic
    assert all(len(r.split(" | ")) == 8 for r in rows)



def test_reuse_bench_labels_skewed_routing(tmp_path):
    """--skew (the DESIGN's labelled variant: Zipf-like expert popularity) reaches the model and the result."""
    out = tmp_path / "reuse.md"
    assert main(["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--history", "64", "--turn", "8",
                 "--edits", "", "--repeats", "1", "--expert-cache", "1MiB", "--turn-paths", "", "--skew", "2",
                 "--out", str(out)]) == 0
    table = out.read_text()
    assert "router skewed to Zipf-like popularity (s=2.0)" in table
    assert [r.split(" | ")[0] for r in table.splitlines() if r.startswith(("| cold", "| reuse"))] == \
        ["| cold", "| reuse"]


def test_calibrated_seeds_the_miss_planner_from_the_runs_measurements(tmp_path, monkeypatch):
    """--calibrated: the planner starts from the link and CPU kernel rates measured in the run (as after `ft
    calibrate`), and the result says so; where no link was measured (no GPU) nothing is seeded or claimed."""
    from freetoken.bench import reuse
    from freetoken.bench.decode import Ceilings

    seeded = []
    planner = Ceilings.planner

    def recorded(self, guard=True):  # the planners actually seeded, by the rates they were seeded from
        made = planner(self, guard)
        if made is not None:
            seeded.append((self.h2d, self.cpu_experts))
        return made

    monkeypatch.setattr(Ceilings, "planner", recorded)
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--history", "32", "--turn", "8",
            "--edits", "", "--repeats", "1", "--expert-cache", "64KiB", "--turn-paths", "", "--calibrated"]
    monkeypatch.setattr(reuse, "measure_ceilings", lambda *args: Ceilings(54.0, 120.0, 80.0))
    assert main([*argv, "--out", str(tmp_path / "a.md")]) == 0
    assert seeded == [(54.0, 80.0)]
    assert "link 54.0 GB/s, CPU expert kernel 80.0 GB/s" in (tmp_path / "a.md").read_text()
    monkeypatch.setattr(reuse, "measure_ceilings", lambda *args: Ceilings(None, 120.0, 80.0))
    assert main([*argv, "--out", str(tmp_path / "b.md")]) == 0
    assert seeded == [(54.0, 80.0)] and "seeded" not in (tmp_path / "b.md").read_text()
