"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3's latent attention (MLA), grouped sigmoid routing and shared experts
(deepseek_v3.py, moe.py), with DeepSeek Sparse Attention (DSA): each query attends only to the `index_topk`
cached tokens a light indexer scores highest.

The indexer has its own heads: a query per head from the query LoRA's normed down-projection (wq_b), one key
per token (wk, then a LayerNorm), both rotated on their first rotary dims with interleaved pairs; a token's
score for a key is Σ_h w_h · relu(q_h · k / √dim), with per-head weights w from weights_proj. Its keys are cached
as extra columns of the token's latent row (the attention query is zero there, so attention ignores them), and
the selection is an `attention.KeySelection` every attention path applies as a mask. Layers marked "shared" in
`indexer_types` have no indexer and reuse the previous full layer's selection (GLM-5's cross-layer sharing).
While a sequence holds at most `index_topk` tokens every key is selected: dense attention.

The multi-token-prediction layer past `num_hidden_layers` loads on request (as in deepseek_v3.py).

Shapes: T tokens, Hi indexer heads, Di indexer head dim, L cached keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from freetoken.engine.config import MoESpec
from freetoken.engine.models import deepseek_v3, mtp
from freetoken.engine.models.decoder import AttentionContext, DecoderArgs, DecoderModel, RMSNorm
from freetoken.engine.models.moe import QWEN_EXPERTS, GroupedRouting
from freetoken.engine.models.mtp import MultiTokenPredictor
from freetoken.engine.rope import apply_rope

MODEL_TYPE = "glm_moe_dsa"
EXPERT_NAMING = QWEN_EXPERTS


@dataclass(slots=True)
class IndexerArgs:
    heads: int
    dim: int
    topk: int
    rope_dim: int
    full: tuple[bool, ...]  # per layer: runs its own indexer; else reuses the previous full layer's selection


@dataclass(slots=True)
class ModelArgs:
    decoder: DecoderArgs
    latent: deepseek_v3.LatentArgs
    routing: GroupedRouting
    indexer: IndexerArgs
    values_are_keys: bool = True
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint appends (num_nextn_predict_layers)
    mtp: bool = False  # the first of them loaded (with_mtp): a layer with its own indexer

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        base = deepseek_v3.ModelArgs.from_config(cfg)
        n = base.decoder.n_layers
        kinds = cfg.get("indexer_types") or ["full"] * n
        if kinds[0] != "full":
            raise ValueError("the first layer of a glm_moe_dsa model must run its own indexer (indexer_types[0])")
        indexer = IndexerArgs(int(cfg["index_n_heads"]), int(cfg["index_head_dim"]), int(cfg["index_topk"]),
                              base.latent.rope_dim, tuple(k == "full" for k in kinds))
        # the cache's one KV "head": [latent, rotary key, indexer key]
        a = base.decoder.attention
        attention = dataclasses.replace(a, head_dim=a.head_dim + indexer.dim)
        return cls(dataclasses.replace(base.decoder, attention=attention), base.latent, base.routing, indexer,
                   mtp_layers=base.mtp_layers)

    def moe_spec(self) -> MoESpec:
        return self.routing.moe_spec(self.decoder.hidden_size)


class Indexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, ia: IndexerArgs):
        super().__init__()
        self.ia = ia
        self.wq_b = nn.Linear(q_lora_rank, ia.heads * ia.dim, bias=False)
        self.wk = nn.Linear(hidden_size, ia.dim, bias=False)
        self.k_norm = nn.LayerNorm(ia.dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, ia.heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first rope_dim dims rotated, their pairs interleaved in the checkpoint (as MLA's rotary dims)."""
        r = self.ia.rope_dim
        rot = torch.cat((x[..., 0:r:2], x[..., 1:r:2]), dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), x[..., r:]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, Di]: each new token's indexer key, as the cache keeps it."""
        return self._rope(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0]

    def selection(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> TopKeys:
        ia, t = self.ia, x.shape[0]

        def scoring() -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hi, Di] queries, [T, Hi] head weights (fp32)
            queries = self._rope(self.wq_b(q_resid).view(t, ia.heads, ia.dim), cos, sin)
            return queries.float(), self.weights_proj(x).float() * ia.heads ** -0.5

        return TopKeys(scoring, ia)


class TopKeys:
    """A full layer's selection (attention.KeySelection): the `topk` visible keys of highest index score per query.
    Keeps what it chose, call by call, for the shared layers after it. Its queries are projected only once some
    call has more than `topk` keys (a shorter sequence attends densely: nothing to score)."""

    def __init__(self, scoring: Callable[[], tuple[torch.Tensor, torch.Tensor]], ia: IndexerArgs):
        self.scoring, self.ia, self.heads = scoring, ia, ia.heads
        self._scores_in: tuple[torch.Tensor, torch.Tensor] | None = None
        self.chosen: list[torch.Tensor] = []

    def visible(self, rows: slice | torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        if keys.shape[-3] > self.ia.topk:
            if self._scores_in is None:
                self._scores_in = self.scoring()
            k = keys[..., 0, -self.ia.dim:].float()  # [..., L, Di]
            q, w = self._scores_in[0][rows], self._scores_in[1][rows]
            if keys.dim() == 4:  # a batched decode step: B sequences of one query each
                q, w = q[:, None], w[:, None]
            scores = torch.relu(torch.einsum("...thd,...ld->...thl", q, k) * self.ia.dim ** -0.5)
            index = torch.einsum("...th,...thl->...tl", w, scores).masked_fill(~visible, float("-inf"))
            # a stable sort, not topk: equal scores (every head's relu at 0) go to the earlier key, so a chunked
            # prefill chooses what a whole one does (which tie topk keeps depends on the row's length)
            top = index.sort(dim=-1, descending=True, stable=True).indices[..., :self.ia.topk]
            visible = visible & torch.zeros_like(visible).scatter_(-1, top, True)
        self.chosen.append(visible)
        return visible


class SharedKeys:
    """A shared layer's selection: the previous full layer's choice for the same call (every layer makes the same
    calls in the same order in one forward)."""

    def __init__(self, source: TopKeys):
        self.source, self.heads, self.calls = source, source.heads, 0

    def visible(self, rows: slice | torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        chosen = self.source.chosen[self.calls]
        self.calls += 1
        if chosen.shape != visible.shape:
            raise RuntimeError(f"a shared DSA layer's call {visible.shape} differs from its full layer's "
                               f"{chosen.shape}")
        return chosen


class SparseLatentAttention(deepseek_v3.LatentAttention):
    def __init__(self, hidden_size: int, n_heads: int, args: ModelArgs, layer_idx: int):
        super().__init__(hidden_size, n_heads, args.latent, layer_idx)
        if not args.latent.q_lora_rank:
            raise ValueError("glm_moe_dsa's indexer reads the query LoRA: q_lora_rank must be set")
        self.index_dim = args.indexer.dim
        if args.indexer.full[layer_idx]:
            self.indexer = Indexer(hidden_size, args.latent.q_lora_rank, args.indexer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
                previous: TopKeys | None) -> tuple[torch.Tensor, TopKeys]:
        """→ (output, the selection the next shared layer reuses)."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        if hasattr(self, "indexer"):
            select = self.indexer.selection(x, q_resid, cos, sin)
            index_key, source = self.indexer.keys(x, cos, sin), select
        else:  # a shared layer caches no indexer keys of its own (zeros keep the pool's one row width)
            select, index_key, source = SharedKeys(previous), x.new_zeros(x.shape[0], self.index_dim), previous
        out = super().forward(x, cos, sin, ctx, q_resid=q_resid, extra_key=index_key, select=select)
        return out, source


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dec = args.decoder
        self.input_layernorm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.self_attn = SparseLatentAttention(dec.hidden_size, dec.attention.n_heads, args, layer_idx)
        self.post_attention_layernorm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.mlp = args.routing.mlp(layer_idx, dec.hidden_size)

    def forward(self, x, cos, sin, ctx: AttentionContext, previous: TopKeys | None):
        out, selection = self.self_attn(self.input_layernorm(x), cos, sin, ctx, previous)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), selection


class SparseMultiTokenPredictor(MultiTokenPredictor):
    """GLM-5's MTP layer: a DSA layer with its own indexer (it reuses no other layer's selection)."""

    def run_layer(self, x, cos, sin, ctx):
        return self.layer(x, cos, sin, ctx, None)[0]


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args.decoder, lambda i: Layer(args, i))
        if args.mtp:
            dec = args.decoder
            self.mtp = SparseMultiTokenPredictor(dec.hidden_size, dec.rms_norm_eps, Layer(args, dec.n_layers))

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        selection = None
        for layer in self.model.layers:
            x, selection = layer(x, cos, sin, ctx, selection)
        return x


def with_mtp(args: ModelArgs) -> ModelArgs:
    """`args` with the multi-token-prediction layer: routed, with its own indexer, at index n_layers."""
    args = mtp.with_mtp(args)
    return dataclasses.replace(args, indexer=dataclasses.replace(args.indexer, full=(*args.indexer.full, True)))


def checkpoint_name(name: str, args: ModelArgs) -> str | None:
    """The multi-token-prediction layers past the model's are left out unless `args.mtp` (see models/mtp.py)."""
    return mtp.checkpoint_name(name, args.decoder.n_layers, args.mtp)
