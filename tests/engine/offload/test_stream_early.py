"""GPU path "stream-early": a prefill chunk whose layer was streamed whole queues the next layer's copies before it
waits for that layer's routing, so the host's queueing overlaps the GPU's work instead of following it; the
chunk's first MoE layer, which no layer streamed, streams itself. On the CPU the copies land at once, so a staging
slot handed to the next layer while this one still needed it would change the logits."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine import experts
from freetoken.engine.loader import load_model
from freetoken.engine.offload import prefill
from support.checkpoints import PARITY_CASES, write_hf_checkpoint
from support.offload_cases import EVEN_SPLIT

# three MoE layers or more: the middle ones stream early (the first has nothing streamed for it, the last no next)
DEEPER = {"qwen3_moe": dict(num_hidden_layers=4, mlp_only_layers=[1]), "mixtral": dict(num_hidden_layers=3)}


@pytest.fixture(scope="module", params=sorted(DEEPER))
def deeper(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(path=path, **PARITY_CASES[request.param], **DEEPER[request.param])
    return path, load_model(path, progress=False)


@pytest.mark.parametrize("slots", [0, 6])
@pytest.mark.parametrize("miss_path", ["copy", "auto"])
@pytest.mark.parametrize("sorted_pass", [False, True])
def test_the_next_layer_streams_before_this_layers_routing(deeper, slots, miss_path, sorted_pass, monkeypatch):
    path, resident = deeper
    on = {"stream-short-chunks", "ahead-batches", "stream-early"}
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in on)
    monkeypatch.setattr(prefill, "grouped_mm_available", lambda hidden: sorted_pass)
    # the sorted pass cuts the slots into windows of 5 rows (torch's 1,023 against an executor's thousands), by the
    # pairs per slot the layer knows on the host
    monkeypatch.setattr(experts, "GROUPED_MM_GROUPS", 5)
    per_expert = resident.moe_spec.bytes_per_expert(torch.float32)
    lm = load_model(path, progress=False, expert_cache=slots * per_expert, prefill_ahead=True)
    ex = lm.experts
    ex.miss_path, ex.planner = miss_path, EVEN_SPLIT()
    ex.AHEAD_BATCH = 2  # several batches a layer, so that the last one's mark is what the sorted pass waits for
    chunk = max(ex.PREFILL_TOKENS, ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT // ex._top_k)
    ids = torch.randint(0, resident.args.decoder.vocab_size, (2 * chunk,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    expected = resident.prefill_logits(ids)

    events = []  # ("route", layer) at each layer's routing, ("stream", layer) as that layer's experts stream
    route, stream = prefill.group_by_expert, ex._stream_layer
    layer_now = []
    forward = ex._forward_grouped
    monkeypatch.setattr(ex, "_forward_grouped", lambda layer, *a: layer_now.append(layer) or forward(layer, *a))
    monkeypatch.setattr(prefill, "group_by_expert", lambda *a: events.append(("route", layer_now[-1])) or route(*a))
    monkeypatch.setattr(ex, "_stream_layer", lambda layer, *a, **k: events.append(("stream", layer))
                        or stream(layer, *a, **k))
    cache = lm.new_cache(page_size=4)
    seq = cache.new_sequence()
    with torch.inference_mode():
        got = [lm.forward(torch.tensor(ids[s:s + chunk]), cache, seq) for s in range(0, len(ids), chunk)]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)

    layers = lm.moe_spec.moe_layers
    c = ex.counters
    streamable = 2 * len(layers) * ex.num_experts  # every layer of both chunks, whole
    assert c.prefetched == streamable if slots == 0 else 0 < c.prefetched <= streamable
    assert c.cpu_experts == 0 and c.evictions == 0 and ex._chunk_ahead is None
    # per chunk: the first layer streams itself, then each layer streams the next before its own routing
    assert len(layers) >= 3
    per_chunk = [("stream", layers[0])]
    for layer, after in zip(layers, [*layers[1:], None], strict=True):
        per_chunk += [("stream", after), ("route", layer)] if after is not None else [("route", layer)]
    assert events == 2 * per_chunk


def test_without_the_path_the_next_layer_streams_after_the_routing(deeper, monkeypatch):
    path, resident = deeper
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in {"stream-short-chunks"})
    lm = load_model(path, progress=False, expert_cache=0, prefill_ahead=True)
    ex = lm.experts
    ex.miss_path = "copy"
    chunk = max(ex.PREFILL_TOKENS, ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT // ex._top_k)
    ids = list(range(chunk))
    order = []
    route, stream = prefill.group_by_expert, ex._stream_next_layer
    monkeypatch.setattr(prefill, "group_by_expert", lambda *a: order.append("route") or route(*a))
    monkeypatch.setattr(ex, "_stream_next_layer", lambda *a, **k: order.append("stream") or stream(*a, **k))
    with torch.inference_mode():
        cache = lm.new_cache(page_size=4)
        lm.forward(torch.tensor(ids), cache, cache.new_sequence())
    assert order == ["route", "stream"] * len(lm.moe_spec.moe_layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("block_share", [0.0, 1.0], ids=["slots", "block-store"])
def test_on_cuda_streaming_early_keeps_the_resident_logits(tmp_path, block_share, monkeypatch):
    """On CUDA the next layer's copies share the copy stream with this layer's: the sorted pass must wait for
    this layer's last batch (not for every copy queued, nor for none), and the ring slots this layer still holds
    must stay its own. Q8_0 experts, in the slots or the block store."""
    from support.checkpoints import write_gguf_from_hf

    write_hf_checkpoint(path=tmp_path / "hf", **PARITY_CASES["qwen3_moe"], **DEEPER["qwen3_moe"])
    gguf = write_gguf_from_hf(tmp_path / "hf", tmp_path / "m.gguf", tensor_type="Q8_0")
    resident = load_model(gguf, device="cuda", dtype=torch.float32, progress=False)
    on = {"stream-short-chunks", "ahead-batches", "stream-early"}
    monkeypatch.setattr(prefill.gpu_paths, "enabled", lambda name: name in on)
    lm = load_model(gguf, device="cuda", dtype=torch.float32, progress=False, prefill_ahead=True,
                    expert_cache=3 * resident.moe_spec.bytes_per_expert(torch.float32), block_share=block_share)
    ex = lm.experts
    ex.miss_path, ex.AHEAD_BATCH = "copy", 2
    early = []
    streams_early = ex._streams_early
    monkeypatch.setattr(ex, "_streams_early", lambda *a: early.append(streams_early(*a)) or early[-1])
    tokens = 2 * ex.num_experts * ex.AHEAD_TOKENS_PER_EXPERT // ex._top_k
    ids = torch.randint(0, resident.args.decoder.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(lm.prefill_logits(ids), resident.prefill_logits(ids), atol=1e-4, rtol=0)
    assert any(early) and (ex.copier.store is not None) == (block_share == 1.0)
