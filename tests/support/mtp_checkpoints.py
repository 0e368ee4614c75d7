"""A multi-token-prediction layer appended to a tiny checkpoint as each family's real checkpoints carry it, and
what a test needs to compute that layer's logits with transformers (tests/engine/test_speculative.py)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from support.checkpoints import _STD, _randomize


@dataclass
class MtpReference:
    """What a test needs to compute an MTP layer's logits with transformers: the layer's own tensors, and a
    one-layer model whose layer is the MTP block, final norm the MTP head's norm and head the main model's."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor
    block: PreTrainedModel
    offset_norms: bool = False  # Qwen3-Next's norms scale by 1 + weight
    h_proj: torch.Tensor | None = None  # DeepSeek-V4: eh_proj is its e_proj, this its h_proj, over the streams

    @torch.no_grad()
    def logits(self, main: PreTrainedModel, ids: list[int]) -> torch.Tensor:
        """[T - 1, vocab]: at each position i < T - 1, the MTP layer's logits of the token at i + 2."""
        if self.h_proj is not None:
            return self._streams_logits(main, ids)
        hidden = main.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        embedded = main.model.embed_tokens(torch.tensor(ids[1:]))
        x = torch.cat((self._rms(embedded, self.enorm, main), self._rms(hidden[:-1], self.hnorm, main)),
                      dim=-1) @ self.eh_proj.T
        return self.block(inputs_embeds=x[None]).logits[0].float()

    def _rms(self, x: torch.Tensor, w: torch.Tensor, main: PreTrainedModel) -> torch.Tensor:
        scale = 1.0 + w if self.offset_norms else w
        return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + main.config.rms_norm_eps))

    def _streams_logits(self, main: PreTrainedModel, ids: list[int]) -> torch.Tensor:
        """DeepSeek-V4: the main model's last streams (the input of its hc_head), each through hnorm and h_proj,
        plus enorm and e_proj of the next token's embedding, through the block's layer as streams, its hc_head,
        norm and the main head."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        seen = []
        hook = main.model.hc_head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
        main.model(torch.tensor([ids]))
        hook.remove()
        streams = seen[0][0, :-1]  # [T - 1, N, Hd]
        embedded = main.model.embed_tokens(torch.tensor(ids[1:]))
        x = self._rms(streams, self.hnorm, main) @ self.h_proj.T + (self._rms(embedded, self.enorm, main)
                                                                     @ self.eh_proj.T)[:, None, :]
        model, pos = self.block.model, torch.arange(x.shape[0])[None]
        plain = x[None, :, 0]
        mask = create_sliding_window_causal_mask(config=self.block.config, inputs_embeds=plain, attention_mask=None,
                                                 cache=None, position_ids=pos)
        ropes = {kind: model.rotary_emb(plain, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        out = model.layers[0](x[None], position_embeddings=ropes, position_ids=pos, attention_mask=mask,
                              input_ids=torch.tensor([ids[1:]]), cache=None)
        return self.block.lm_head(model.norm(model.hc_head(out)))[0].float()


def add_mtp_layer(path: Path, main: PreTrainedModel, seed: int = 1) -> MtpReference:
    """Appends a random multi-token-prediction layer to the deepseek_v3, deepseek_v4, glm4_moe, glm_moe_dsa,
    qwen3_next or qwen3_5_moe checkpoint at `path` as their checkpoints carry it, in its own shard: DeepSeek-V4's
    as `mtp.0.*` (e_proj and h_proj, its own hc_head, a sliding-window routed block); DeepSeek-V3's and GLM's as
    `model.layers.{n}.*` with `num_nextn_predict_layers: 1` (and the copies of the embedding and head the engine
    does not load), Qwen3-Next's and Qwen3.5's as `mtp.*` (fc, pre_fc_norm_embedding / _hidden, norm, layers.0 a
    full-attention routed layer)."""
    n, model_type = main.config.num_hidden_layers, main.config.model_type
    qwen, v4 = model_type in ("qwen3_next", "qwen3_5_moe_text"), model_type == "deepseek_v4"
    one_layer = {"num_hidden_layers": 1}  # a routed full-attention layer (GLM-5's with its own indexer)
    if v4:  # a sliding-window layer routed by top-k
        one_layer |= {"layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]}
    elif qwen:
        one_layer |= {"layer_types": ["full_attention"], "mlp_only_layers": []}
    else:
        one_layer |= {"first_k_dense_replace": 0}
        if getattr(main.config, "layer_types", None):
            one_layer["layer_types"] = main.config.layer_types[:1]
        if getattr(main.config, "mlp_layer_types", None):
            one_layer["mlp_layer_types"] = ["sparse"]
        if model_type == "glm_moe_dsa":
            one_layer["indexer_types"] = ["full"]
    cfg = type(main.config).from_dict({**main.config.to_dict(), **one_layer})
    torch.manual_seed(seed)
    block = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(block, seed)
    with torch.no_grad():
        block.lm_head.weight.copy_(main.lm_head.weight)
    block.eval()
    with tempfile.TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)
        saved = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            saved |= load_file(f)
    gen = torch.Generator().manual_seed(seed)
    hidden, base = cfg.hidden_size, 0.0 if qwen else 1.0  # (Qwen's norms scale by 1 + weight)
    enorm, hnorm = (base + torch.randn(hidden, generator=gen) * _STD for _ in range(2))
    ref = MtpReference(enorm, hnorm, torch.randn(hidden, 2 * hidden, generator=gen) * _STD, block, offset_norms=qwen)
    if v4:
        ref.h_proj = torch.randn(hidden, hidden, generator=gen) * _STD
        ref.eh_proj = ref.eh_proj[:, :hidden].contiguous()
    prefix = "mtp.layers.0." if qwen else "mtp.0." if v4 else f"model.layers.{n}."
    tensors = {prefix + k[len("model.layers.0."):]: v for k, v in saved.items() if k.startswith("model.layers.0.")}
    if v4:
        tensors |= {"mtp.0.enorm.weight": ref.enorm, "mtp.0.hnorm.weight": ref.hnorm,
                    "mtp.0.e_proj.weight": ref.eh_proj, "mtp.0.h_proj.weight": ref.h_proj,
                    "mtp.0.norm.weight": saved["model.norm.weight"],
                    **{f"mtp.0.hc_head_{k}": saved[f"model.hc_head.hc_{k}"] for k in ("fn", "base", "scale")},
                    "mtp.0.emb.tok_emb.weight": main.model.embed_tokens.weight.detach().clone(),
                    "mtp.0.head.weight": main.lm_head.weight.detach().clone()}
    elif qwen:
        tensors |= {"mtp.pre_fc_norm_embedding.weight": ref.enorm, "mtp.pre_fc_norm_hidden.weight": ref.hnorm,
                    "mtp.fc.weight": ref.eh_proj, "mtp.norm.weight": saved["model.norm.weight"]}
    else:
        tensors |= {prefix + "enorm.weight": ref.enorm, prefix + "hnorm.weight": ref.hnorm,
                    prefix + "eh_proj.weight": ref.eh_proj,
                    prefix + "shared_head.norm.weight": saved["model.norm.weight"],
                    prefix + "shared_head.head.weight": main.lm_head.weight.detach().clone(),
                    prefix + "embed_tokens.weight": main.model.embed_tokens.weight.detach().clone()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model-mtp.safetensors")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] |= {k: "model-mtp.safetensors" for k in tensors}
    index_file.write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return ref
