"""1,000 random session operations (send, fork, checkpoint, rollback, edit, close) on a tiny random model: every
page is held exactly by the sessions and checkpoints that own it, replies equal fresh runs of their history,
and nothing leaks once everything is closed."""

from __future__ import annotations

import random

import pytest

import freetoken
from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, write_hf_checkpoint

WORDS = ["alpha", "beta", "gamma", "delta", "tool", "file", "run", "test", "fix", "patch"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(path=path, **PARITY_CASES["llama"])
    engine = freetoken.Engine(load_model(path, progress=False))
    yield engine
    engine.close()


def _holders(engine, sessions) -> dict[int, int]:
    counts: dict[int, int] = {}
    for s in sessions:
        for seq in [s._seq] + [ck[2] for ck in s._checkpoints.values()]:
            for p in seq.pages:
                counts[p] = counts.get(p, 0) + 1
    for page, _, _ in engine.prefix._pages.values():  # the engine-wide index of whole pages
        counts[page] = counts.get(page, 0) + 1
    return counts


def test_random_operations_keep_pages_exact_and_replies_fresh(engine):
    rng = random.Random(0)
    sessions = [engine.session(system="You are a tiny test model.")]
    sends = checked = 0
    for step in range(1000):
        s = rng.choice(sessions)
        op = rng.random()
        if op < 0.45:
            if len(s.messages) >= 7:  # the tiny model's context is short: start this one over
                s.close()
                sessions[sessions.index(s)] = s = engine.session(system="You are a tiny test model.")
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 6)))
            reply = s.send(text, max_tokens=rng.randrange(1, 4))
            sends += 1
            if sends % 25 == 0:  # a sample of replies against a fresh run of the same history
                history = s.messages[:-1]
                tok = engine.lm.tokenizer
                prompt = tok.encode(tok.apply_chat_template(history))
                params = SamplingParams(temperature=0, max_tokens=len(reply.token_ids) or 1)
                fresh = Generator(engine.lm).generate_ids(prompt, params)
                assert reply.token_ids == fresh[:len(reply.token_ids)], step
                checked += 1
        elif op < 0.6 and len(sessions) < 8:
            sessions.append(s.fork())
        elif op < 0.72:
            s.checkpoint(rng.choice("ab"))
        elif op < 0.82:
            name = rng.choice("ab")
            if name in s._checkpoints:
                s.rollback(name)
        elif op < 0.92:
            n = len(s.messages)
            if n > 1:
                s.edit(rng.randrange(1, n), " ".join(rng.choice(WORDS) for _ in range(3)))
        elif len(sessions) > 1:
            s.close()
            sessions.remove(s)
        engine.run(lambda: None)  # everything queued so far has run
        assert _holders(engine, sessions) == engine.cache.allocator.refs, step
    assert sends > 300 and checked >= 10
    for s in sessions:
        s.close()
    engine.prefix.clear()
    allocator = engine.cache.allocator
    assert allocator.num_free == allocator.num_pages and not allocator.refs
