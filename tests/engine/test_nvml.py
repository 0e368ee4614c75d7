"""Other processes' GPU memory from NVML: None wherever NVML cannot tell (no driver, an unknown device, a process
list without this process), so the stats fall back to their estimate; on a CUDA machine with NVML, a sane figure."""

from __future__ import annotations

import os

import pytest
import torch

from freetoken.engine import nvml


def test_without_nvml_or_the_device_the_answer_is_none(monkeypatch):
    monkeypatch.setattr(nvml, "_library", lambda: None)
    assert nvml.other_processes_bytes("0000:65:00.0") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and its driver's NVML)")
def test_on_cuda_nvml_sees_this_process_and_counts_the_others():
    torch.zeros(1, device="cuda")  # a context, so NVML lists this process
    bus = nvml.bus_id_of(torch.device("cuda"))
    assert bus is not None and bus.count(":") == 2
    if nvml._library() is None:
        pytest.skip("no NVML on this machine")
    other = nvml.other_processes_bytes(bus)
    free, total = torch.cuda.mem_get_info()
    if other is None:  # another pid namespace: NVML lists host pids
        assert nvml.other_processes_bytes(bus, pid=-1) is None
        return
    assert 0 <= other <= total - free
    assert nvml.other_processes_bytes(bus, pid=os.getpid() + 10**7) is None  # a pid it does not list
    assert nvml.other_processes_bytes("ffff:ff:ff.0") is None  # no such device
