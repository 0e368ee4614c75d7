"""`ft bench serve` runs end to end on a tiny model and writes its tables."""

from __future__ import annotations

from freetoken.cli import main as ft_main
from support.checkpoints import PARITY_CASES, write_hf_checkpoint


def test_bench_serve_reports_overhead_and_concurrent_rows(tmp_path, capsys):
    write_hf_checkpoint(path=tmp_path / "m", **PARITY_CASES["qwen3_moe"])
    out = tmp_path / "serve.md"
    assert ft_main(["bench", "serve", "--model", str(tmp_path / "m"), "--sessions", "1,3", "--tokens", "6",
                    "--repeats", "1", "--commit", "abc123", "--out", str(out)]) == 0
    text = out.read_text()
    assert "commit: abc123" in text and "| server, 1 streaming session |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 2 and all(float(r.split("|")[2]) > 0 for r in rows)
