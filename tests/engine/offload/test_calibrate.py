"""`ft calibrate` measures, saves a profile keyed by the machine, and reads it back."""

from __future__ import annotations

import torch

from freetoken.engine.offload.calibrate import calibrate, load_profile, profile_path, save_profile


def test_quick_calibration_on_the_cpu_round_trips_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    device = torch.device("cpu")
    assert load_profile(device) is None
    profile = calibrate(device, torch.float32, quick=True)
    assert profile.dram_read_gb_s > 0 and profile.cpu_expert_gb_s > 0
    assert profile.h2d_gb_s is None and profile.gpu_expert_gb_s is None and profile.gpu is None
    path = save_profile(profile)
    assert path == profile_path(profile.key) and path.is_relative_to(tmp_path)
    assert load_profile(device) == profile


def test_a_corrupt_profile_reads_as_uncalibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    profile = calibrate(torch.device("cpu"), torch.float32, quick=True)
    save_profile(profile).write_text("{not json")
    assert load_profile(torch.device("cpu")) is None


def test_an_uncalibrated_machine_is_told_how_to_calibrate(tmp_path, monkeypatch, caplog):
    """Without a profile the miss planner starts from a slow machine's bandwidths: loading says so once, with the
    command that fixes it; a profile without a GPU link (a CPU-only machine) seeds nothing and says nothing."""
    import logging

    from freetoken.engine.loader import planner_for

    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="freetoken.engine.loader"):
        assert planner_for(torch.device("cpu")) is None
    assert [r.getMessage() for r in caplog.records if "ft calibrate" in r.getMessage()]
    caplog.clear()
    save_profile(calibrate(torch.device("cpu"), torch.float32, quick=True))
    with caplog.at_level(logging.INFO, logger="freetoken.engine.loader"):
        assert planner_for(torch.device("cpu")) is None
    assert not caplog.records
