"""`ft calibrate`: measures the bandwidths that decide where a missed expert should be computed, and stores them
as a profile keyed by GPU, CPU model and PCIe link under the user cache directory.

Measured: pinned host→device copy GB/s, host DRAM read GB/s, and expert throughput (weight GB/s streamed
through one SwiGLU expert at batch 1) on the CPU and on the device. The miss planner and the benchmarks' floors
read the profile; `load_profile` returns None when this machine was never calibrated.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from freetoken.engine.experts import expert_mlp
from freetoken.engine.sources import cache_dir
from freetoken.kernels.cpu_experts.kernel import CpuExpertKernel

# Qwen3-30B-A3B's expert shape: what the profile's expert throughputs refer to.
EXPERT_HIDDEN, EXPERT_INTERMEDIATE = 2048, 768


@dataclass(slots=True, frozen=True)
class Profile:
    key: str
    gpu: str | None
    cpu: str
    pcie_link: str | None
    h2d_gb_s: float | None  # pinned host → device
    dram_read_gb_s: float
    cpu_expert_gb_s: float  # expert weight bytes per second through the CPU at batch 1
    gpu_expert_gb_s: float | None
    dtype: str
    measured_at: str


def _median_seconds(fn, sync, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync_for(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure_h2d(device: torch.device, nbytes: int) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_seconds(lambda: dst.copy_(src, non_blocking=True), _sync_for(device), 5) / 1e9


def measure_dram_read(nbytes: int) -> float:
    """One read of a buffer much larger than the caches on every core (the CPU kernel's probe), or a torch
    reduction where the kernel is unavailable: bound by DRAM reads, not arithmetic."""
    kernel = CpuExpertKernel.get()
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    read = (lambda: kernel.read_bytes(buf)) if kernel is not None else buf.sum
    return nbytes / _median_seconds(read, lambda: None, 5) / 1e9


def measure_expert(device: torch.device, dtype: torch.dtype, n_experts: int) -> float:
    """Weight GB/s of batch-1 SwiGLU experts, cycling through `n_experts` so the weights come from memory; on
    the CPU through the expert kernel the engine uses (torch where it cannot be built)."""
    h, i = EXPERT_HIDDEN, EXPERT_INTERMEDIATE
    kernel = CpuExpertKernel.get() if device.type == "cpu" else None
    if kernel is not None and dtype in (torch.bfloat16, torch.float32):
        from freetoken.kernels.cpu_experts import bench
        return bench.expert_gb_s(kernel, "BF16" if dtype == torch.bfloat16 else "F32", 1,
                                 max(8, n_experts // 8 * 8), "kernel", torch.Generator().manual_seed(0))
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [tuple(torch.rand(shape, generator=gen, device=device).to(dtype) * 0.02
                     for shape in ((i, h), (i, h), (h, i))) for _ in range(n_experts)]
    x = torch.rand(1, h, device=device).to(dtype)

    def run():
        for g, u, d in weights:
            expert_mlp(x, g, u, d)

    seconds = _median_seconds(run, _sync_for(device), 3)
    return n_experts * 3 * h * i * dtype.itemsize / seconds / 1e9


def machine_key(device: torch.device) -> tuple[str, str | None, str, str | None]:
    cpu = _cpu_model()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    link = _pcie_link(device)
    key = re.sub(r"[^A-Za-z0-9]+", "-", "_".join(filter(None, (gpu or "cpu-only", cpu, link)))).strip("-")
    return key, gpu, cpu, link


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _pcie_link(device: torch.device) -> str | None:
    """"Gen-speed xWidth" from sysfs for the GPU's PCI address, when torch and the OS expose it."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    base = Path("/sys/bus/pci/devices") / address
    try:
        speed, width = ((base / f"current_link_{what}").read_text().strip() for what in ("speed", "width"))
        return f"{speed} x{width}"
    except OSError:
        return None


def calibrate(device: torch.device, dtype: torch.dtype = torch.bfloat16, quick: bool = False) -> Profile:
    key, gpu, cpu, link = machine_key(device)
    size = (64 if quick else 1024) * 2**20
    experts = 4 if quick else 64
    return Profile(
        key=key, gpu=gpu, cpu=cpu, pcie_link=link,
        h2d_gb_s=measure_h2d(device, size),
        dram_read_gb_s=measure_dram_read(size),
        cpu_expert_gb_s=measure_expert(torch.device("cpu"), dtype, experts),
        gpu_expert_gb_s=measure_expert(device, dtype, experts) if device.type == "cuda" else None,
        dtype=str(dtype).removeprefix("torch."),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def profile_path(key: str) -> Path:
    return cache_dir() / "calibration" / f"{key}.json"


def save_profile(profile: Profile) -> Path:
    path = profile_path(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=2))
    tmp.replace(path)
    return path


def load_profile(device: torch.device) -> Profile | None:
    path = profile_path(machine_key(device)[0])
    try:
        return Profile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def main(verb: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ft calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="small buffers: seconds instead of a minute, rougher")
    a = p.parse_args(argv)
    profile = calibrate(torch.device(a.device), getattr(torch, a.dtype), a.quick)
    path = save_profile(profile)
    for field, value in asdict(profile).items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"{field:<18} {shown}")
    print(f"saved to {path}")
    return 0
