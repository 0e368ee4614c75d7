"""What one streamed reply measures: its decode rate overall and past its first pieces."""

import pytest

from freetoken.eval.client import Outcome


def test_the_steady_rate_leaves_the_first_pieces_out():
    # 11 tokens, one a piece: the first 4 gaps slow (100 ms), then 10 ms apiece
    times = [0.0, 100.0, 200.0, 300.0, 400.0, 410.0, 420.0, 430.0, 440.0, 450.0, 460.0]
    out = Outcome(output_tokens=11, pieces=11, decode_s=0.46, piece_ms=times)
    assert out.decode_tok_s == pytest.approx(10 / 0.46)
    assert out.steady_decode_tok_s == pytest.approx(6 / 0.06)  # from piece 4 (400 ms) to the end: 6 tokens


def test_pieces_carrying_several_tokens_are_scaled_to_tokens():
    times = [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0]  # 9 pieces of 2 tokens, the first of 1
    out = Outcome(output_tokens=17, pieces=9, decode_s=0.08, piece_ms=times)
    assert out.steady_decode_tok_s == pytest.approx(16 * 4 / 8 / 0.04)


@pytest.mark.parametrize("pieces", [0, 1, 7])
def test_too_short_a_reply_has_no_steady_rate(pieces):
    times = [float(i) for i in range(pieces)]
    out = Outcome(output_tokens=pieces, pieces=pieces, decode_s=pieces / 1e3 or None, piece_ms=times or None)
    assert out.steady_decode_tok_s is None
