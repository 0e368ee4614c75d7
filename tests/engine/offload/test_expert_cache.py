"""Expert-cache bookkeeping and eviction policies: plain Python, checked against their definitions."""

import random

import pytest

from freetoken.engine.offload.expert_cache import ExpertCache
from freetoken.engine.offload.policy import FrequencyPolicy, LRUPolicy, make_policy


def test_lru_evicts_the_least_recently_used():
    cache = ExpertCache(2, LRUPolicy())
    cache.admit("a"), cache.admit("b")
    cache.begin_step(["c"])
    assert cache.lookup("a") == cache.slot_of["a"]  # a is now the most recent
    slot, evicted = cache.admit("c")
    assert evicted == "b" and cache.slot_of == {"a": cache.slot_of["a"], "c": slot}
    assert (cache.counters.hits, cache.counters.evictions) == (1, 1)


def test_frequency_keeps_popular_keys_through_a_burst_of_one_offs():
    cache = ExpertCache(2, FrequencyPolicy())
    cache.admit("hot")
    for _ in range(5):
        cache.lookup("hot")
    for cold in ["c1", "c2", "c3", "c4"]:
        cache.begin_step([cold])
        if cache.lookup(cold) is None:
            cache.admit(cold)
    assert "hot" in cache.slot_of


def test_frequency_counts_age_so_popularity_can_shift():
    policy = FrequencyPolicy(half_life=4)
    policy.admit("old")
    for _ in range(7):
        policy.touch("old")
    for _ in range(40):  # many halvings later "old" is worth less than a fresh key used twice
        policy.admit("new")
        policy.touch("new")
        policy.remove("new")
    policy.admit("new")
    policy.touch("new")
    assert policy.victim() == "old"


def test_protected_keys_are_never_evicted_and_a_full_protected_cache_refuses():
    cache = ExpertCache(2, LRUPolicy())
    cache.admit("a"), cache.admit("b")
    cache.begin_step(["a", "b", "c"])
    assert cache.admit("c") is None
    assert set(cache.slot_of) == {"a", "b"}


def test_zero_capacity_admits_nothing():
    cache = ExpertCache(0, make_policy("freq"))
    cache.begin_step(["a"])
    assert cache.lookup("a") is None and cache.admit("a") is None and cache.counters.misses == 1


@pytest.mark.parametrize("policy", ["lru", "freq"])
def test_random_workload_keeps_the_slot_invariants(policy):
    rng = random.Random(0)
    cache = ExpertCache(5, make_policy(policy))
    for step in range(500):
        needed = rng.sample(range(12), 3)
        cache.begin_step(needed)
        for key in needed:
            if cache.lookup(key) is None:
                assert cache.admit(key) is not None  # 3 needed ≤ 5 slots: always room
        slots = list(cache.slot_of.values())
        assert len(slots) == len(set(slots)) and all(0 <= s < 5 for s in slots)
        assert len(slots) + len(cache.free_slots) == 5
        if step == 250:
            moves = cache.resize(3)
            assert len(cache.slot_of) <= 3 and all(new < 3 for _, _, new in moves)
            cache.resize(5)
    c = cache.counters
    assert c.hits + c.misses == 500 * 3 and 0 < c.hit_rate < 1


def test_growing_keeps_every_entry():
    cache = ExpertCache(2, LRUPolicy())
    cache.admit("a"), cache.admit("b")
    assert cache.resize(4) == [] and set(cache.slot_of) == {"a", "b"} and len(cache.free_slots) == 2


class _ScanFrequency:
    """The frequency policy's definition, evaluated by brute force: score = Σ 2^(use clock / half-life)."""

    def __init__(self, half_life: int):
        self.half_life, self.clock, self.score, self.history = half_life, 0, {}, {}

    def _use(self, key, base):
        self.clock += 1
        self.score[key] = base + 2.0 ** (self.clock / self.half_life)

    def miss(self, key):
        self.clock += 1
        self.history[key] = self.history.get(key, 0.0) + 2.0 ** (self.clock / self.half_life)

    def admit(self, key):
        self.score[key] = self.history.pop(key)

    def touch(self, key):
        self._use(key, self.score[key])

    def remove(self, key):
        self.history[key] = self.score.pop(key)

    def victim(self, protected=()):
        candidates = [k for k in self.score if k not in set(protected)]
        return min(candidates, key=self.score.__getitem__) if candidates else None


# half-life 8: the policy rescales every 512 uses, five times in this run; rescaling multiplies by a power of
# two, which changes no comparison, so its victims must still match the unscaled scan exactly.
@pytest.mark.parametrize("half_life", [8, 4096])
def test_frequency_heap_picks_the_same_victims_as_a_full_scan(half_life):
    rng = random.Random(half_life)
    fast, slow = FrequencyPolicy(half_life), _ScanFrequency(half_life)
    cached: set[int] = set()
    for _ in range(3000):
        key = rng.randrange(40)
        if key in cached:
            fast.touch(key), slow.touch(key)
        elif len(cached) < 12:
            fast.miss(key), slow.miss(key)
            fast.admit(key), slow.admit(key)
            cached.add(key)
        else:
            protected = set(rng.sample(sorted(cached), 3))
            victim = fast.victim(protected)
            assert victim == slow.victim(protected) and victim not in protected
            fast.remove(victim), slow.remove(victim)
            cached.discard(victim)
    assert len(fast._heap) <= 4 * len(cached) + 64  # stale entries are compacted away


def test_admission_control_streams_one_offs_and_admits_keys_that_keep_coming():
    cache = ExpertCache(2, make_policy("freq-admit"))
    for key in ("hot1", "hot2"):
        cache.begin_step([key])
        cache.lookup(key)
        cache.admit(key)
    for _ in range(3):
        for key in ("hot1", "hot2"):
            cache.lookup(key)
    cache.begin_step(["once"])
    assert cache.lookup("once") is None and cache.admit("once") is None  # one use < the victim's four
    assert set(cache.slot_of) == {"hot1", "hot2"} and cache.counters.rejected == 1
    admitted = None
    for _ in range(6):  # "new" keeps being asked for: its count overtakes the colder hot key's
        cache.begin_step(["new"])
        if cache.lookup("new") is None:
            admitted = cache.admit("new")
    assert admitted is not None and "new" in cache.slot_of


def test_pinned_keys_are_never_evicted_and_bound_the_shrink():
    cache = ExpertCache(4, make_policy("freq"))
    assert cache.pin([(0, 0), (0, 1)]) and set(cache.slot_of) == {(0, 0), (0, 1)}
    for e in range(2, 12):  # a burst of other experts: they take turns in the two unpinned slots
        cache.begin_step([(1, e)])
        if cache.lookup((1, e)) is None:
            cache.admit((1, e))
        assert {(0, 0), (0, 1)} <= set(cache.slot_of)
    with pytest.raises(ValueError, match="pinned"):
        cache.resize(1)
    with pytest.raises(ValueError, match="grow the cache"):
        cache.pin([(2, e) for e in range(3)])  # 5 pinned in 4 slots
    cache.resize(2)
    assert set(cache.slot_of) == {(0, 0), (0, 1)}
    cache.unpin([(0, 0), (0, 1)])
    cache.resize(1)
    assert len(cache.slot_of) == 1


@pytest.mark.parametrize("policy", ["lru", "freq", "freq-admit"])
def test_a_step_recorded_after_its_lookups_leaves_the_cache_as_lookups_do(policy):
    """Decode peeks at `slot_of`, starts its CPU share, then records the step's uses at once (`record_uses`):
    counts, per-layer counts, last use and every later eviction must match looking each key up in turn."""
    rng = random.Random(3)
    steps = [[(rng.randrange(4), e) for e in rng.sample(range(32), 6)] for _ in range(300)]
    caches = [ExpertCache(24, make_policy(policy)) for _ in range(2)]
    for keys in steps:
        layer = keys[0][0]
        keys = [(layer, e) for _, e in keys]
        for i, cache in enumerate(caches):
            cache.begin_step(keys)
            if i == 0:
                looked = [cache.lookup(k) for k in keys]
            else:
                looked = [cache.slot_of.get(k) for k in keys]
                cache.record_uses(layer, keys)
            for key, slot in zip(keys, looked, strict=True):
                if slot is None:
                    cache.admit(key)
    a, b = caches
    assert a.counters == b.counters and a.counters.evictions > 0 and a.counters.hits > 0
    assert (a.slot_of, a.layer_counts, a.last_used) == (b.slot_of, b.layer_counts, b.last_used)


@pytest.mark.parametrize("policy", ["freq", "lru"])
def test_keys_admitted_with_hold_survive_the_same_steps_later_admissions(policy):
    """A prefetch admits several predictions in a row. A fresh key is the frequency policy's coldest, so without
    `hold` each admission evicted the one before it and a prefetch into a full cache copied one expert a layer
    (H200, D1 at 8-16 GiB: 47 prefetches a token over 48 layers, against 190 with no cache)."""
    cache = ExpertCache(6, make_policy(policy))
    warm = [(0, e) for e in range(6)]
    cache.begin_step(warm)
    for key in warm:
        cache.admit(key)
    for _ in range(3):  # the cached keys are used: older and hotter than anything admitted next
        cache.record_uses(0, warm)
    cache.begin_step([(1, 0)])
    slots = [cache.admit((2, e), hold=True)[0] for e in range(3)]
    assert len(set(slots)) == 3 and all((2, e) in cache.slot_of for e in range(3))
    assert all(cache.admit((2, e), hold=True) is not None for e in (3, 4, 5))
    assert cache.admit((2, 6), hold=True) is None  # every slot held: the prediction is not copied
    cache.begin_step([(3, 0)])  # the next step protects its own keys only: held keys may go again
    assert cache.admit((3, 0))[1] in {(2, e) for e in range(6)}
