"""`ft bench prefill` on a CPU-sized synthetic model: every strategy, budget and prompt gets a complete row."""

from __future__ import annotations

from freetoken.bench.prefill import main


def test_bench_prefill_reports_every_row(tmp_path):
    out = tmp_path / "p1.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--prompts", "96,300", "--chunk", "128",
            "--budgets", "0,1MiB", "--strategies", "resident,copy,auto", "--repeats", "2", "--out", str(out)]
    assert main(argv) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    assert [(r[0].strip(), r[1].strip(), int(r[2])) for r in rows] == [
        ("resident", "all", 96), ("resident", "all", 300), ("copy", "0", 96), ("copy", "0", 300),
        ("copy", "1MiB", 96), ("copy", "1MiB", 300), ("auto", "0", 96), ("auto", "0", 300),
        ("auto", "1MiB", 96), ("auto", "1MiB", 300)]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)  # TTFT and prefill tok/s
    assert all(float(r[5]) > 0 for r in rows if r[0].strip() == "copy")  # the naive path streams every miss
    # auto splits misses between copies and the CPU as its planner learns this machine: either way it handles them
    assert all(float(r[5]) > 0 or int(r[6]) > 0 for r in rows if r[0].strip() == "auto")


def test_the_ahead_strategies_stream_more_than_they_need_and_report_it(tmp_path):
    """`-ahead` rows copy each next layer's experts before it routes: at least as many bytes as the plain row, and
    the same first token (the lossless check column)."""
    out = tmp_path / "p1.md"
    argv = ["--shape", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--prompts", "200", "--chunk", "64",
            "--budgets", "0", "--strategies", "copy,copy-ahead", "--out", str(out)]
    assert main(argv) == 0
    rows = {r[0].strip(): r for r in (line.split("|")[1:-1] for line in out.read_text().splitlines()
                                      if line.startswith("| ") and "---" not in line) if r[0].strip() != "strategy"}
    assert set(rows) == {"copy", "copy-ahead"}
    assert float(rows["copy-ahead"][5]) >= float(rows["copy"][5]) > 0
    assert rows["copy"][10].strip() == rows["copy-ahead"][10].strip() == "yes"
