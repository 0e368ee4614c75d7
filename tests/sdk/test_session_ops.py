"""Random session operations (send, fork, checkpoint, rollback, edit, close) on a tiny random model, as a
Hypothesis state machine: over 1,000 operations in 30 runs of up to 50, shrunk to a shortest failing sequence
if one ever fails. After every operation each page is held exactly by the sessions and checkpoints that own it (and the
prefix index), replies equal fresh runs of their history, and nothing leaks once a run's sessions are closed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import freetoken
from freetoken.engine.generator import Generator
from freetoken.engine.loader import load_model
from freetoken.engine.sampling import SamplingParams
from support.checkpoints import PARITY_CASES, write_hf_checkpoint

WORDS = ["alpha", "beta", "gamma", "delta", "tool", "file", "run", "test", "fix", "patch"]
SYSTEM = "You are a tiny test model."
RUNS, STEPS = 30, 50  # ~1,500 operations; the runs draw their own lengths


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


class SessionOps(RuleBasedStateMachine):
    engine = None  # set by the test: one model for every run
    done = {"operations": 0, "sends": 0, "checked": 0}  # over every run, so the test can tell it ran them

    def __init__(self):
        super().__init__()
        self.sessions = [self.engine.session(system=SYSTEM)]
        self.sends = 0

    @rule(i=st.integers(0, 7), words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5),
          max_tokens=st.integers(1, 3))
    def send(self, i, words, max_tokens):
        s = self._pick(i)
        if len(s.messages) >= 7:  # the tiny model's context is short: start this one over
            s.close()
            self.sessions[self.sessions.index(s)] = s = self.engine.session(system=SYSTEM)
        reply = s.send(" ".join(words), max_tokens=max_tokens)
        self.sends += 1
        self.done["sends"] += 1
        if self.sends % 4 == 0:  # a sample of replies against a fresh run of the same history
            tok = self.engine.lm.tokenizer
            prompt = tok.encode(tok.apply_chat_template(s.messages[:-1]))
            params = SamplingParams(temperature=0, max_tokens=len(reply.token_ids) or 1)
            fresh = Generator(self.engine.lm).generate_ids(prompt, params)
            assert reply.token_ids == fresh[:len(reply.token_ids)]
            self.done["checked"] += 1

    @rule(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5))
    def follow_up(self, words):
        """The newest session's next turn: agents mostly extend the branch they just made."""
        self.send(len(self.sessions) - 1, words, 2)

    @precondition(lambda self: len(self.sessions) < 8)
    @rule(i=st.integers(0, 7))
    def fork(self, i):
        self.sessions.append(self._pick(i).fork())

    @rule(i=st.integers(0, 7), name=st.sampled_from("ab"))
    def checkpoint(self, i, name):
        self._pick(i).checkpoint(name)

    @rule(i=st.integers(0, 7), name=st.sampled_from("ab"))
    def rollback(self, i, name):
        s = self._pick(i)
        if name in s._checkpoints:
            s.rollback(name)

    @rule(i=st.integers(0, 7), at=st.integers(1, 6), words=st.lists(st.sampled_from(WORDS), min_size=3, max_size=3))
    def edit(self, i, at, words):
        s = self._pick(i)
        if len(s.messages) > 1:
            s.edit(1 + (at - 1) % (len(s.messages) - 1), " ".join(words))

    @precondition(lambda self: len(self.sessions) > 1)
    @rule(i=st.integers(0, 7))
    def close(self, i):
        s = self._pick(i)
        s.close()
        self.sessions.remove(s)

    @invariant()
    def pages_are_held_exactly_by_their_owners(self):
        self.engine.run(lambda: None)  # everything queued so far has run
        self.done["operations"] += 1
        assert _holders(self.engine, self.sessions) == self.engine.cache.allocator.refs

    def teardown(self):
        for s in self.sessions:
            s.close()
        self.engine.prefix.clear()
        allocator = self.engine.cache.allocator
        assert allocator.num_free == allocator.num_pages and not allocator.refs

    def _pick(self, i: int):
        return self.sessions[i % len(self.sessions)]


def test_random_operations_keep_pages_exact_and_replies_fresh(engine):
    SessionOps.engine = engine
    run_state_machine_as_test(SessionOps, settings=settings(
        max_examples=RUNS, stateful_step_count=STEPS, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    done = SessionOps.done
    assert done["operations"] >= 1000 + RUNS and done["sends"] >= 250 and done["checked"] >= 50, done
