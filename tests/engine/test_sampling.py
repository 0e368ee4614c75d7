"""Sampling filters against their definitions, seeding, parameter validation, and stop strings."""

import pytest
import torch

from freetoken.engine.sampling import Sampler, SamplingParams, filtered_probs
from freetoken.engine.stops import StopMatcher
from freetoken.errors import FreeTokenError

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingParams(temperature=0), torch.device("cpu"))(LOGITS) == 0


def test_top_k_keeps_k_most_likely():
    p = filtered_probs(LOGITS, top_k=2, top_p=1.0, min_p=0.0)
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    p = filtered_probs(LOGITS, top_k=0, top_p=0.8, min_p=0.0)  # 0.5 + 0.2 < 0.8 ≤ 0.5 + 0.2 + 0.15
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert filtered_probs(LOGITS, 0, 0.3, 0.0).tolist() == [1.0, 0, 0, 0, 0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    p = filtered_probs(LOGITS, top_k=0, top_p=1.0, min_p=0.3)  # threshold 0.15
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_temperature_sampling_follows_the_distribution_and_seed_reproduces():
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [Sampler(params, torch.device("cpu")) for _ in range(2)]
    a = [draws[0](LOGITS) for _ in range(4000)]
    b = [draws[1](LOGITS) for _ in range(4000)]
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=5).float() / len(a)
    assert torch.allclose(freq, LOGITS.exp(), atol=0.03)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                    dict(max_tokens=0), dict(top_k=-1)])
def test_bad_parameters_are_rejected_with_the_name(kwargs):
    with pytest.raises(FreeTokenError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_stop_strings_are_held_back_and_cut():
    m = StopMatcher(("</end>", "STOP"))
    out = []
    for delta in ["Hello </", "en", "x> and ST", "OP later"]:
        text, stopped = m.feed(delta)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello </enx> and " and stopped


def test_text_without_stop_passes_through_after_flush():
    m = StopMatcher(("STOP",))
    text = "".join(m.feed(d)[0] for d in ["ab", "S", "T"]) + m.flush()
    assert text == "abST"


def test_a_vanishing_temperature_samples_greedily_instead_of_overflowing():
    logits = torch.tensor([0.0, 3.0, 1.0])
    for t in (1e-300, 5e-324, 1e-5):
        params = SamplingParams(temperature=t)
        assert params.greedy and Sampler(params, torch.device("cpu"))(logits) == 1
    assert not SamplingParams(temperature=1e-3).greedy


def test_a_vanishing_top_p_keeps_the_top_token():
    probs = filtered_probs(torch.tensor([0.0, 3.0, 1.0]), top_k=0, top_p=5e-324, min_p=0.0)  # 0 in fp32
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_the_matcher_says_which_stop_string_matched_first():
    m = StopMatcher(("world", "lo w"))
    assert m.feed("hel") == ("he", False) and m.matched is None  # "l" may begin "lo w": held
    assert m.feed("lo world") == ("l", True) and m.matched == "lo w"  # it starts before "world"


def test_any_integer_seed_is_taken_and_reproduces():
    """APIs pass any integer (negative, past 64 bits); torch seeds are 64-bit: the seed is taken modulo 2**64."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    for seed in (-1, 2**70, 2**64 + 5):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert Sampler(params, torch.device("cpu"))(logits) == Sampler(params, torch.device("cpu"))(logits)
