"""Recurrent state (linear attention, SSM layers) on a tiny model whose second layer is a gated linear recurrence:
it cannot be rolled back, a fork snapshots it, and sessions restart from snapshots taken at message boundaries,
continuing exactly as a fresh run of the same history would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import freetoken
from freetoken.engine.generator import Generator
from freetoken.engine.kv_cache import RecurrentStateError
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, prompt_ids, write_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class GatedRecurrence(nn.Module):
    """h_t = a * h_{t-1} + (1 - a) * W_in x_t, y_t = W_out h_t: a layer whose state sums up every token."""

    recurrent = True

    def __init__(self, hidden: int, layer_idx: int, generator: torch.Generator):
        super().__init__()
        self.layer_idx = layer_idx
        self.decay = nn.Parameter(torch.randn(hidden, generator=generator))
        self.inp = nn.Parameter(torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5)
        self.out = nn.Parameter(torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5)

    def forward(self, x, cos, sin, ctx):
        state = ctx.recurrent_state(self.layer_idx)
        h = state[0] if state is not None else torch.zeros(x.shape[-1], device=x.device)
        a, u = torch.sigmoid(self.decay), x.float() @ self.inp.t()
        outs = []
        for t in range(x.shape[0]):
            h = a * h + (1 - a) * u[t]
            outs.append(h)
        ctx.set_recurrent_state(self.layer_idx, (h,))
        return (torch.stack(outs) @ self.out.t()).to(x.dtype)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(path=path, **PARITY_CASES["llama"])
    lm = load_model(path, progress=False)
    layer = lm.model.model.layers[1]
    layer.self_attn = GatedRecurrence(lm.model.args.hidden_size, 1, torch.Generator().manual_seed(0))
    assert lm.has_recurrent_state
    return lm


def test_a_fork_is_a_snapshot_and_truncation_is_refused(lm):
    gen = Generator(lm)
    first, second = prompt_ids("The quick brown fox"), prompt_ids(" jumps over the lazy dog")
    seq = gen.cache().new_sequence()
    gen.prefill(seq, first)
    snapshot = gen.cache().fork(seq)
    with pytest.raises(RecurrentStateError, match="restore a snapshot"):
        gen.cache().truncate(seq, 3)
    straight = [t for ev in gen.extend(seq, second, GREEDY) for t in ev.token_ids]
    restored = gen.cache().fork(snapshot)  # back to the end of `first`, after `seq` moved on
    again = [t for ev in gen.extend(restored, second, GREEDY) for t in ev.token_ids]
    assert straight == again == gen.generate_ids(first + second, GREEDY)
    for s in (seq, snapshot, restored):
        gen.cache().release(s)
    assert gen.cache().allocator.num_free == gen.cache().allocator.num_pages


def test_sessions_restart_from_message_boundaries_and_match_fresh_runs(lm):
    engine = freetoken.Engine(lm)

    def fresh(messages, n):
        tok = lm.tokenizer
        return Generator(lm).generate_ids(tok.encode(tok.apply_chat_template(messages)),
                                          SamplingParams(temperature=0, max_tokens=n))

    session = engine.session(system="You are a tiny recurrent test model.")
    session.SNAPSHOT_EVERY = 16  # the coarse fallback inside long messages, at this tiny scale
    one = session.send("first question", max_tokens=4)
    assert one.token_ids == fresh(session.messages[:-1], 4)
    assert any(at % 16 == 0 for at in session._snapshots)
    two = session.send("second question", max_tokens=4)
    assert two.token_ids == fresh(session.messages[:-1], 4)
    assert two.stats.cached_tokens > 0  # restarted from the snapshot at the end of the last message it kept
    branch = session.fork()
    b = branch.send("a branch", max_tokens=4)
    assert b.token_ids == fresh(branch.messages[:-1], 4)
    session.edit(1, "an edited first question")  # restarts from the system prompt's boundary
    edited = session.send("third", max_tokens=4)
    assert edited.token_ids == fresh(session.messages[:-1], 4)
    assert 0 < edited.stats.cached_tokens < two.stats.cached_tokens
    session.checkpoint("here")
    session.send("more", max_tokens=4).wait()
    session.rollback("here")
    back = session.send("instead", max_tokens=4)
    assert back.token_ids == fresh(session.messages[:-1], 4)
    for s in (session, branch):
        s.close()
    allocator = engine.cache.allocator
    assert allocator.num_free == allocator.num_pages
    engine.close()


def test_forks_and_rollbacks_keep_the_snapshots_an_edit_restarts_from(lm):
    """A fork carries the snapshots of its history, and a rollback keeps those within the history the checkpoint
    shares: an edit after either recomputes from the last message boundary before it, not from the first token,
    and still answers as a fresh run of the edited history."""
    engine = freetoken.Engine(lm)
    tok = lm.tokenizer

    def fresh(messages, n):
        return Generator(lm).generate_ids(tok.encode(tok.apply_chat_template(messages)),
                                          SamplingParams(temperature=0, max_tokens=n))

    session = engine.session(system="You are a tiny recurrent test model.")
    session.send("first question", max_tokens=4).wait()
    session.send("second question", max_tokens=4).wait()
    branch = session.fork()
    branch.edit(3, "an edited second question")
    edited = branch.send("then", max_tokens=4)
    assert edited.token_ids == fresh(branch.messages[:-1], 4)
    assert edited.stats.cached_tokens > 0  # the fork's copy of the snapshot at the end of the first answer
    session.checkpoint("two")
    session.send("third question", max_tokens=4).wait()
    session.rollback("two")
    session.edit(3, "another second question")
    again = session.send("then", max_tokens=4)
    assert again.token_ids == fresh(session.messages[:-1], 4) and again.stats.cached_tokens > 0
    for s in (session, branch):
        s.close()
    allocator = engine.cache.allocator
    assert allocator.num_free == allocator.num_pages
    engine.close()


def test_an_edit_after_a_reasoning_block_restarts_from_the_block_end(lm, monkeypatch):
    """Snapshots are also taken after each block-closing marker (`</think>`, `</tool_call>`, ...) inside a message:
    an agent rewriting the text after a reasoning block recomputes from the block's end, not the message's start.
    The tiny vocabulary has no `</think>`, so one of its ordinary tokens plays the closing marker here."""
    tok = lm.tokenizer
    marker = tok.encode(" the")[-1]
    monkeypatch.setattr(type(tok), "block_end_ids", lambda self: frozenset({marker}))
    answer = "thinking about the question the answer is"
    engine = freetoken.Engine(lm)
    session = engine.session(system="s", messages=[{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": answer}])
    session.send("next", max_tokens=2).wait()
    prompt = tok.encode(tok.apply_chat_template(session.messages[:-1]))
    closes = [i + 1 for i, t in enumerate(prompt) if t == marker]
    assert closes and set(closes) <= set(session._snapshots)
    session.edit(2, answer.replace("answer is", "reply was"))  # after the last marker only
    edited = session.send("next", max_tokens=2)
    messages = session.messages[:-1]
    fresh = Generator(lm).generate_ids(tok.encode(tok.apply_chat_template(messages)),
                                       SamplingParams(temperature=0, max_tokens=2))
    assert edited.token_ids == fresh
    assert edited.stats.cached_tokens == max(closes)  # the last block end before the edit
    session.close()
    engine.close()


def _serve(scheduler, prompt: list[int], params=GREEDY):
    """One request through the batch scheduler (as the server runs it); returns its tokens and the request."""
    from freetoken.engine.batching import BatchRequest

    out: list[int] = []
    req = BatchRequest(prompt, params, emit=lambda ev: out.extend(ev.token_ids))
    scheduler.add(req)
    while scheduler.active:
        scheduler.step()
    return out, req


def test_the_server_scheduler_restarts_recurrent_models_from_snapshots(lm):
    """The server's batch scheduler cannot share pages of a recurrent model, so it keeps whole sequences: each
    prompt's end and each finished request. An agent's next turn (the last prompt, the reply, new text) starts
    from the longer one, an edited turn from the prompt end it still shares, and each answer equals a fresh
    run; the pool takes snapshots back when it needs pages, and every page comes back in the end."""
    from freetoken.engine.batching import BatchScheduler

    scheduler = BatchScheduler(lm, prefill_chunk=8)
    fresh = Generator(lm).generate_ids
    first = prompt_ids("The quick brown fox jumps over")
    one, req = _serve(scheduler, first)
    assert one == fresh(first, GREEDY) and req.cached == 0
    assert len(scheduler.snapshots) == 2  # the prompt's end and the finished request
    turn = first + one[:-1] + prompt_ids(" the lazy dog")  # the reply as it was fed, then new text
    two, req = _serve(scheduler, turn)
    assert two == fresh(turn, GREEDY) and req.cached == len(first) + len(one) - 1
    edited = first + prompt_ids(" and something else entirely")  # the reply rewritten: the prompt end remains
    three, req = _serve(scheduler, edited)
    assert three == fresh(edited, GREEDY) and req.cached == len(first)
    unrelated = prompt_ids("Nothing in common")
    four, req = _serve(scheduler, unrelated)
    assert four == fresh(unrelated, GREEDY) and req.cached == 0
    assert scheduler.snapshots.hits == 2 and len(scheduler.snapshots) <= scheduler.snapshots.max_snapshots
    allocator = scheduler.cache.allocator
    assert scheduler.snapshots.evict(1) > 0  # what the pool's reclaim hook calls when it runs short
    scheduler.snapshots.clear()
    assert allocator.num_free == allocator.num_pages and not allocator.refs


def test_a_full_pool_takes_recurrent_snapshots_back_first(lm):
    """With a pool of a few pages, the snapshots of earlier requests give their pages back so a new request
    fits; it then runs from scratch and still equals a fresh run."""
    from freetoken.engine.batching import BatchScheduler

    scheduler = BatchScheduler(lm, prefill_chunk=8, kv_tokens=64, page_size=16)
    fresh = Generator(lm).generate_ids
    for text in ("The quick brown fox jumps over", "A different prompt, long enough to need the pages"):
        prompt = prompt_ids(text)
        out, req = _serve(scheduler, prompt)
        assert out == fresh(prompt, GREEDY) and not isinstance(out, BaseException)
    assert scheduler.snapshots.evicted > 0
