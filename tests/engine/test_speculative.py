"""Multi-token prediction and speculative decoding on tiny deepseek_v3, glm4_moe and qwen3_next checkpoints with an
MTP layer appended as DeepSeek-V3, GLM-4.5 and Qwen3-Next ship it: the layer's logits against transformers (its
block run as a one-layer transformers model), and speculative decoding's tokens equal to plain greedy decoding's —
with the random MTP layer (drafts mostly rejected), with drafts that are always right, and with experts offloaded
below the pool. Qwen3-Next's recurrent layers cannot drop a rejected draft: their pass is redone without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.speculative import MtpSpeculator
from freetoken.errors import FreeTokenError, ModelLoadError
from support.checkpoints import hf_greedy, prompt_ids, write_gguf_from_hf, write_hf_checkpoint
from support.mtp_checkpoints import add_mtp_layer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v4", "glm4_moe", "glm_moe_dsa", "qwen3_next",
                                                 "qwen3_5_moe"])
def checkpoint(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    main = write_hf_checkpoint(request.param, path)
    reference = add_mtp_layer(path, main)
    return path, main, reference, hf_greedy(main, prompt_ids(), GREEDY.max_tokens)


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False, mtp=True)


def test_the_mtp_layer_loads_beside_the_model(checkpoint, lm):
    """The layer's own tensors land under `mtp`, its routed experts as one more expert layer (n_layers); without
    `mtp=True` nothing of it loads; the cache gets a row per token for it."""
    n = lm.args.decoder.n_layers
    assert lm.has_mtp and lm.moe_spec.moe_layers[-1] == n
    assert torch.equal(lm.model.mtp.enorm.weight, checkpoint[2].enorm)
    mtp = lm.model.mtp
    assert torch.equal((mtp.e_proj if hasattr(mtp, "e_proj") else mtp.eh_proj).weight, checkpoint[2].eh_proj)
    assert len(lm.new_cache(initial_tokens=4).k) == n + 1
    plain = load_model(checkpoint[0], device="cpu", dtype=torch.float32, progress=False)
    assert not plain.has_mtp and n not in plain.moe_spec.moe_layers and len(plain.new_cache().k) == n
    torch.testing.assert_close(plain.prefill_logits(prompt_ids()), lm.prefill_logits(prompt_ids()), atol=0, rtol=0)


@torch.inference_mode()
def test_mtp_logits_match_transformers(checkpoint, lm):
    """At every prompt position (filled in two calls, so the second attends to the first's MTP rows), the MTP
    layer's logits equal transformers' computation of the same layer within 3e-4 (+ 1e-4 relative)."""
    path, main, reference, _ = checkpoint
    ids = prompt_ids()
    cache = lm.new_cache(page_size=4, initial_tokens=len(ids))
    seq = cache.new_sequence()
    _, hidden = lm.forward_hidden(torch.tensor(ids), cache, seq)
    cut = len(ids) // 2
    tokens = torch.tensor(ids[1:])
    got = torch.cat((lm.draft(hidden[:cut], tokens[:cut], cache, seq, 0),
                     lm.draft(hidden[cut:-1], tokens[cut:], cache, seq, cut)))
    # (the MTP layer stacks on the main model's hidden state: its rounding adds to the main model's. On a Xeon host
    # (other vector widths, so other summation orders than this AMD one) V4 and Qwen3.5 differed by up to 1.7e-4.)
    torch.testing.assert_close(got, reference.logits(main, ids), atol=3e-4, rtol=1e-4)


def test_a_gguf_files_nextn_block_is_the_mtp_layer(checkpoint, tmp_path):
    """GLM-4.5 GGUFs carry the MTP layer as one more block (`blk.{n}.nextn.*` beside its ordinary tensors, the
    block count and `nextn_predict_layers` counting it): loaded from an F32 GGUF written from the checkpoint, its
    logits are transformers' and speculative decoding keeps the greedy tokens."""
    path, main, reference, expected = checkpoint
    if main.config.model_type != "glm4_moe":
        pytest.skip("the GGUF writer of the tests covers glm4moe")
    lm = load_model(write_gguf_from_hf(path, tmp_path / "mtp.gguf"), device="cpu", dtype=torch.float32,
                    progress=False, mtp=True)
    ids = prompt_ids()
    with torch.inference_mode():
        cache = lm.new_cache(initial_tokens=len(ids))
        seq = cache.new_sequence()
        _, hidden = lm.forward_hidden(torch.tensor(ids), cache, seq)
        got = lm.draft(hidden[:-1], torch.tensor(ids[1:]), cache, seq, 0)
    torch.testing.assert_close(got, reference.logits(main, ids), atol=1e-4, rtol=0)
    assert Generator(lm, speculative=True).generate_ids(ids, GREEDY) == expected


@pytest.mark.parametrize("chunk", [None, 3])
def test_speculative_greedy_tokens_equal_plain_decoding(checkpoint, lm, chunk):
    """The random MTP layer's drafts are checked each step; whatever it guesses, the tokens are transformers'
    greedy ones (prefill whole or in chunks of 3, which the MTP rows follow one position behind)."""
    gen = Generator(lm, speculative=True, prefill_chunk=chunk, page_size=4)
    assert gen.generate_ids(prompt_ids(), GREEDY) == checkpoint[3]
    stats = gen.draft_stats
    assert stats.proposed > 0 and 0 <= stats.accepted <= stats.proposed
    if lm.has_recurrent_state:  # each rejected draft's pass is redone without it
        assert stats.redone >= stats.proposed - stats.accepted > 0
    else:
        assert stats.redone == 0


def _oracle(expected: list[int], prompt_len: int, vocab: int, wrong: bool):
    """A stand-in for the MTP layer's draft: the right token for the position (or always a wrong one)."""

    def draft(self, hidden, next_ids, cache, seq, start):
        self.lm.draft(hidden, torch.tensor(next_ids), cache, seq, start)  # the rows are still written
        index = start + len(next_ids) + 1 - prompt_len  # the generated token the draft stands for
        right = expected[index] if index < len(expected) else 0
        return (right + 1) % vocab if wrong else right

    return draft


@pytest.mark.parametrize("wrong", [False, True])
def test_accepted_and_rejected_drafts_give_the_same_tokens(checkpoint, lm, monkeypatch, wrong):
    """Drafts that are always right are all accepted: two tokens a pass, half the passes; always wrong ones are
    all rejected: one token a pass. The tokens are the same either way."""
    expected, ids = checkpoint[3], prompt_ids()
    monkeypatch.setattr(MtpSpeculator, "_draft", _oracle(expected, len(ids), lm.args.decoder.vocab_size, wrong))
    gen = Generator(lm, speculative=True, page_size=4)
    cache = gen.cache(len(ids) + GREEDY.max_tokens)
    seq = cache.new_sequence()
    assert [t for ev in gen.extend(seq, ids, GREEDY) for t in ev.token_ids] == expected
    assert seq.length == len(ids) + len(expected) - 1  # every token but the last sampled one, as plain decoding
    stats = gen.draft_stats
    if wrong:
        assert stats.accepted == 0 and stats.proposed == len(expected) - 1
    else:
        assert stats.accepted == stats.proposed and stats.proposed <= len(expected) // 2
    # the cache rows are plain decoding's: continuing matches a fresh run of the history (the last token never fed)
    more = [t for ev in gen.extend(seq, [7, 9], GREEDY) for t in ev.token_ids]
    assert more == Generator(lm).generate_ids(ids + expected[:-1] + [7, 9], GREEDY)
    cache.release(seq)


def test_offloaded_speculative_decoding_keeps_the_tokens(checkpoint):
    """Experts far below the pool (the MTP layer's among them, in the same cache): the same greedy tokens, and
    the MTP layer's experts went through the executor."""
    path, _, _, expected = checkpoint
    resident = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True, expert_cache=3 * per_expert)
    layers, forward = [], lm.experts.forward

    def recording(layer, *args, **kwargs):
        layers.append(layer)
        return forward(layer, *args, **kwargs)

    lm.experts.forward = recording
    gen = Generator(lm, speculative=True, page_size=4)
    assert gen.generate_ids(prompt_ids(), GREEDY) == expected
    n = lm.args.decoder.n_layers
    # the MTP layer ran on the prompt, for the first draft and after every pass but the last (the reply ended)
    assert n in lm.experts.host and layers.count(n) == 1 + 1 + gen.draft_stats.proposed - 1


def test_ft_info_names_the_mtp_layer(checkpoint, tmp_path):
    from freetoken.engine.model_info import describe

    assert "MTP layer      present: --speculative" in describe(str(checkpoint[0]))
    plain = tmp_path / "plain"
    model_type = checkpoint[1].config.model_type
    write_hf_checkpoint({"qwen3_5_moe_text": "qwen3_5_moe"}.get(model_type, model_type), plain)
    assert "MTP layer" not in describe(str(plain))


def test_clear_errors_without_an_mtp_layer(tmp_path, checkpoint):
    if checkpoint[1].config.model_type != "deepseek_v3":
        pytest.skip("one family is enough")
    """A checkpoint without the layer, a family without MTP support, a model loaded without it: one clear
    error each."""
    write_hf_checkpoint("deepseek_v3", tmp_path / "plain")
    with pytest.raises(ModelLoadError, match="no multi-token-prediction layer"):
        load_model(tmp_path / "plain", progress=False, mtp=True)
    write_hf_checkpoint("qwen3_moe", tmp_path / "qwen")
    with pytest.raises(ModelLoadError, match="qwen3_moe models have no multi-token-prediction support"):
        load_model(tmp_path / "qwen", progress=False, mtp=True)
    plain = load_model(checkpoint[0], progress=False)
    with pytest.raises(FreeTokenError, match="load it with mtp=True"):
        Generator(plain, speculative=True)


def test_sdk_sessions_decode_speculatively(checkpoint):
    """`Engine.load(..., speculative=True)`: a session's replies, a fork's and a rollback's, are the plain
    engine's."""
    from freetoken.sdk import Engine

    replies = []
    for speculative in (False, True):
        engine = Engine.load(str(checkpoint[0]), device="cpu", speculative=speculative)
        try:
            session = engine.session(system="be brief")
            first = session.send("hello there", max_tokens=10).text
            session.checkpoint("one")
            second = session.send("and more", max_tokens=10).text
            fork = session.fork().send("a branch", max_tokens=10).text
            session.rollback("one")
            again = session.send("and more", max_tokens=10).text
            replies.append((first, second, fork, again))
            assert (engine.generator.draft_stats is not None) == speculative
        finally:
            engine.close()
    assert replies[0] == replies[1] and replies[1][1] == replies[1][3]


def _run_scheduler(scheduler, prompts: list[list[int]], params, late: int | None = None):
    """Each prompt's tokens through the scheduler; the prompt at index `late` joins once the others decode."""
    from freetoken.engine.batching import BatchRequest

    out = [[] for _ in prompts]
    reqs = [BatchRequest(p, params, emit=lambda ev, i=i: out[i].extend(ev.token_ids)) for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):
        if i != late:
            scheduler.add(r)
    steps = 0
    while scheduler.active or (late is not None and reqs[late].seq is None):
        scheduler.step()
        steps += 1
        if late is not None and steps == 6:
            scheduler.add(reqs[late])
    return out


def test_the_scheduler_decodes_a_lone_request_speculatively(checkpoint, lm, monkeypatch):
    """`BatchScheduler(speculative=True)`: a request alone prefills in chunks with its MTP rows and decodes two
    tokens a pass when the draft is right; requests that overlap share plain steps; every request gets the tokens
    it gets alone without speculation, and every page comes back."""
    from freetoken.engine.batching import BatchScheduler

    expected, ids = checkpoint[3], prompt_ids()
    others = [prompt_ids("Hi"), prompt_ids("The quick brown fox")]
    plain = [Generator(lm).generate_ids(p, GREEDY) for p in [ids, *others]]
    assert plain[0] == expected
    scheduler = BatchScheduler(lm, prefill_chunk=5, speculative=True)
    assert _run_scheduler(scheduler, [ids], GREEDY) == [expected]
    alone = scheduler.forwards
    monkeypatch.setattr(MtpSpeculator, "_draft", _oracle(expected, len(ids), lm.args.decoder.vocab_size, False))
    scheduler = BatchScheduler(lm, prefill_chunk=5, speculative=True)
    assert _run_scheduler(scheduler, [ids], GREEDY) == [expected]
    stats = scheduler.speculator.stats
    assert stats.accepted == stats.proposed > 0 and scheduler.forwards < alone - 8  # two tokens a pass
    monkeypatch.undo()
    scheduler = BatchScheduler(lm, prefill_chunk=5, speculative=True)
    assert _run_scheduler(scheduler, [ids, *others], GREEDY, late=2) == plain
    (scheduler.prefix or scheduler.snapshots).clear()  # what later prompts could reuse (recurrent: snapshots)
    allocator = scheduler.cache.allocator
    assert allocator.num_free == allocator.num_pages


def test_speculative_serving_needs_the_mtp_layer(checkpoint):
    from freetoken.engine.batching import BatchScheduler

    with pytest.raises(FreeTokenError, match="multi-token-prediction"):
        BatchScheduler(load_model(checkpoint[0], progress=False), speculative=True)


def test_concurrent_requests_each_decode_two_tokens_a_pass(checkpoint, lm, monkeypatch):
    """Requests that share steps bring their drafts too (two rows each): with drafts always right, two
    concurrent requests finish in about half the steps plain batching takes, with the same tokens."""
    from freetoken.engine.batching import BatchRequest, BatchScheduler

    prompts = [prompt_ids(), prompt_ids("The quick brown fox")]
    expected = [Generator(lm).generate_ids(p, GREEDY) for p in prompts]
    plain = BatchScheduler(lm, prefill_chunk=64)
    assert _run_scheduler(plain, prompts, GREEDY) == expected
    scheduler = BatchScheduler(lm, prefill_chunk=64, speculative=True)
    truth = {}  # a sequence → its prompt length and its right tokens

    def draft(self, hidden, next_ids, cache, seq, start):
        self.lm.draft(hidden, torch.tensor(next_ids), cache, seq, start)
        prompt_len, right = truth[id(seq)]
        index = start + len(next_ids) + 1 - prompt_len
        return right[index] if index < len(right) else 0

    monkeypatch.setattr(MtpSpeculator, "_draft", draft)
    out = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        req = BatchRequest(p, GREEDY, emit=lambda ev, i=i: out[i].extend(ev.token_ids))
        scheduler.add(req)
        truth[id(req.seq)] = (len(p), expected[i])
    while scheduler.active:
        scheduler.step()
    assert out == expected
    stats = scheduler.speculator.stats
    assert stats.accepted == stats.proposed > 0 and scheduler.forwards <= plain.forwards // 2 + 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=40),  # EOS may end it
    SamplingParams(temperature=0.8, max_tokens=20, seed=7, top_k=20),  # the sampler's own draws, in order
    SamplingParams(temperature=0.0, max_tokens=30, json_object=True),  # constrained: one JSON object
], ids=["one-token", "two-tokens", "eos", "sampled", "json"])
def test_every_way_a_reply_ends_is_plain_decodings(checkpoint, lm, params, monkeypatch):
    """Budgets of one and two tokens, EOS, a seeded sampler and a constrained one: with drafts always right (so
    passes end mid-pair) the reply's text and tokens are plain decoding's; a stop string cuts it the same way."""
    ids = prompt_ids()
    plain_text, plain_last = Generator(lm).generate_text(ids, params)
    plain_ids = Generator(lm).generate_ids(ids, params)
    monkeypatch.setattr(MtpSpeculator, "_draft", _oracle(plain_ids, len(ids), lm.args.decoder.vocab_size, False))
    gen = Generator(lm, speculative=True)
    assert gen.generate_ids(ids, params) == plain_ids
    text, last = Generator(lm, speculative=True).generate_text(ids, params)
    assert (text, last.finish_reason, last.completion_tokens) == (plain_text, plain_last.finish_reason,
                                                                 plain_last.completion_tokens)
    if len(plain_text) > 4:
        stop = dataclasses.replace(params, stop=(plain_text[2:4],))
        assert Generator(lm, speculative=True).generate_text(ids, stop)[0] == Generator(lm).generate_text(ids, stop)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("offload", [False, True])
def test_on_cuda_speculative_tokens_equal_plain_decoding(checkpoint, offload):
    """On the GPU (fp32): speculative decoding's greedy tokens are those of plain decoding through CUDA graphs,
    resident and with experts offloaded below the pool."""
    path, _, _, expected = checkpoint
    options = {}
    if offload:
        probe = load_model(path, progress=False)
        options["expert_cache"] = 3 * probe.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, device="cuda", dtype=torch.float32, progress=False, mtp=True, **options)
    plain = Generator(lm).generate_ids(prompt_ids(), GREEDY)
    assert Generator(lm, speculative=True).generate_ids(prompt_ids(), GREEDY) == plain
