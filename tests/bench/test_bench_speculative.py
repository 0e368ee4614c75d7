"""`ft bench speculative` on the tiny MLA shape (CPU): every row present, the forced acceptance is what the
drafts got, and accepted drafts halve the main model's passes."""

from __future__ import annotations

import pytest

from freetoken.bench.speculative import main


def test_speculative_bench_writes_every_row(tmp_path):
    out = tmp_path / "speculative.md"
    argv = ["--shape", "tiny-mla", "--device", "cpu", "--dtype", "float32", "--context", "24", "--tokens", "12",
            "--warmup", "2", "--budgets", "all,64KiB", "--acceptance", "0,1", "--out", str(out)]
    assert main(argv) == 0
    table = out.read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| all", "| 64KiB"))]
    modes = ["plain, eager", "speculative, 0% drafts right", "speculative, 100% drafts right"]
    assert [(r[0], r[1]) for r in rows] == [(budget, m) for budget in ("| all", "| 64KiB") for m in modes]
    passes = [int(r[3]) for r in rows]
    assert passes == [12, 12, 6, 12, 12, 6]  # 12 timed tokens: a pass each, plain or every draft wrong; 6 of two
    assert [r[2] for r in rows] == ["", "0%", "100%", "", "0%", "100%"]
    assert all(float(r[4]) > 0 for r in rows) and "ft bench speculative" in table


def test_a_shape_without_an_mtp_layer_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--shape", "qwen3-30b-a3b", "--device", "cpu"])
    assert exit_info.value.code == 2 and "no multi-token-prediction layer" in capsys.readouterr().err
