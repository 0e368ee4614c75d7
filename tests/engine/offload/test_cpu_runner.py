"""The CPU miss path's runner: what it asks the native kernel to read ahead (GPU path "cpu-warm")."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.experts import LayerExperts
from freetoken.engine.offload.cpu_experts import CpuExpertRunner


@pytest.fixture
def runner():
    gen = torch.Generator().manual_seed(0)
    experts, inter, hidden = 6, 32, 64
    host = {3: LayerExperts(torch.randn(experts, inter, hidden, generator=gen),
                            torch.randn(experts, inter, hidden, generator=gen),
                            torch.randn(experts, hidden, inter, generator=gen))}
    r = CpuExpertRunner(host, torch.float32, share_cores=False)
    if r.kernel is None:
        pytest.skip("no C compiler: the runner falls back to torch and reads nothing ahead")
    return r, host[3]


def test_warming_reads_the_experts_gate_up_then_down_rows_up_to_the_byte_cap(runner, monkeypatch):
    r, layer = runner
    asked = []
    monkeypatch.setattr(r.kernel, "warm", lambda regions: asked.append(regions) or True)
    expert_bytes = 32 * 64 * 4  # one projection of one expert, fp32
    assert r.warm(3, [4, 1])
    regions = asked[-1]
    want = [(t.data_ptr() + e * expert_bytes, expert_bytes)
            for t in (layer.gate_proj, layer.up_proj, layer.down_proj) for e in (4, 1)]
    assert regions == want  # the order the job reads them in: every gate/up row before the down rows
    monkeypatch.setattr(CpuExpertRunner, "WARM_BYTES", 2 * expert_bytes + 100)
    assert r.warm(3, [4, 1])
    assert asked[-1] == [*want[:2], (want[2][0], 100)]  # cut at the cap, part of a projection included
    assert not r.warm(3, []) and not r.warm(7, [0])  # nothing to read, or a layer it does not hold
    assert len(asked) == 2


def test_owned_warming_reads_whole_experts_up_to_the_cap_and_turns_owned_rows_on(runner, monkeypatch):
    """GPU path "cpu-warm-owned": the kernel reads the experts' rows by the workers that will compute them
    (`warm_rows`, whole experts within the byte cap), and owned rows are switched on for every call once."""
    from freetoken.engine import gpu_paths

    r, _ = runner
    monkeypatch.setattr(gpu_paths, "enabled", lambda path: path == "cpu-warm-owned")
    asked, switched = [], []
    monkeypatch.setattr(r.kernel, "warm_rows", lambda constants, experts, hidden:
                        asked.append((constants, experts.tolist(), hidden)) or True)
    monkeypatch.setattr(r.kernel, "set_owned_rows", lambda on: switched.append(on) or False)
    assert r.warm(3, [4, 1, 5])
    assert asked[-1] == (r._launch_constants[3], [4, 1, 5], 64) and switched == [True]
    monkeypatch.setattr(CpuExpertRunner, "WARM_BYTES", 2 * 3 * 32 * 64 * 4 + 100)  # two experts and a bit
    assert r.warm(3, [4, 1, 5])
    assert asked[-1][1] == [4, 1] and switched == [True]
    monkeypatch.setattr(gpu_paths, "enabled", lambda path: False)
    monkeypatch.setattr(r.kernel, "warm", lambda regions: True)
    assert r.warm(3, [4]) and switched == [True, False]  # back to the plain form: owned rows off again
