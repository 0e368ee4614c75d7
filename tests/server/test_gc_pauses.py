"""The collector's pauses in a serving process: counted per generation, and what loading left frozen out of the
scans until the last server closes."""

import gc

from freetoken.server.gc_pauses import GcPauses, freeze_loaded, thaw


def test_pauses_are_counted_per_generation_between_start_and_stop():
    pauses = GcPauses()
    pauses.start()
    try:
        gc.collect(0)
        gc.collect()  # a full collection
    finally:
        pauses.stop()
    snap = pauses.snapshot()
    assert pauses.collections[0] >= 1 and snap["full_collections"] >= 1
    assert snap["collections"] == sum(pauses.collections) >= 2
    assert 0 < snap["full_pause_seconds"] <= snap["pause_seconds"]
    assert snap["longest_pause_seconds"] <= snap["pause_seconds"]
    gc.collect()  # after stop: not counted
    assert pauses.snapshot()["collections"] == snap["collections"]


def test_the_loaded_heap_is_frozen_until_the_last_server_thaws_it():
    assert gc.get_freeze_count() == 0
    kept = [[i] for i in range(1000)]  # alive at "load": frozen with the rest
    freeze_loaded()
    freeze_loaded()  # a second server in the same process
    try:
        assert gc.get_freeze_count() >= len(kept)
        thaw()
        assert gc.get_freeze_count() >= len(kept)  # one server still open
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
