"""A tiny llama GGUF for driving real coding agents in CI: SmolLM2's real tokenizer and chat template, a 64k-token
context (the agents' first requests are 10–20k tokens, past SmolLM2's own 8k), and weights built so that every
reply is "Hello" and then end-of-turn.

Why built weights: an agent must finish its turn, and a random model would talk until the output budget, which
agents treat as an error or a truncated reply. The model still runs through the whole engine (every layer computes;
prefill over the agent's full prompt), but its layers are near zero, so the residual stream at the last position is
that token's embedding and the next token depends on it alone: the generation prompt's final "\n" leads to
"Hello", and "Hello" (like every other token) leads to end-of-turn, each by a logit margin of ~30.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from freetoken.bench.export import _add_kv
from freetoken.engine.formats.gguf_file import GGUFFile

DIM, HEADS, KV_HEADS, FFN, LAYERS, CONTEXT = 64, 4, 2, 128, 2, 65536
REPLY = "Hello"


def write_agent_model(path: Path, smollm2: Path) -> Path:
    """Writes the model to `path` (F32) from the tokenizer of the SmolLM2 GGUF at `smollm2`."""
    from freetoken.engine.tokenizer import Tokenizer

    source = GGUFFile(smollm2)
    tokenizer = Tokenizer.from_gguf_metadata(source.metadata)
    vocab = len(source.metadata["tokenizer.ggml.tokens"])
    eos = int(source.metadata["tokenizer.ggml.eos_token_id"])
    (newline,) = tokenizer.encode("\n")
    (hello,) = tokenizer.encode(REPLY)
    rng = np.random.default_rng(0)
    e = np.eye(DIM, dtype=np.float32)

    embed = rng.normal(0, 0.02, (vocab, DIM)).astype(np.float32) + 4 * e[0]  # every token: mostly direction 0
    embed[newline] += 4 * e[1]
    embed[hello] += 4 * e[2]
    output = rng.normal(0, 0.01, (vocab, DIM)).astype(np.float32)
    output[eos] = 6 * e[0]  # end-of-turn wins wherever direction 1 is absent ...
    output[newline] = output[hello] = 0  # ... and nothing else can (no newline runs)
    output[hello] = 12 * e[1]  # after "\n", "Hello" wins by twice the margin

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny-agent-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(DIM // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in source.metadata.items():
        if key.startswith("tokenizer."):
            _add_kv(w, key, value)

    def small(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.002, shape).astype(np.float32)

    head = DIM // HEADS
    w.add_tensor("token_embd.weight", embed)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(DIM, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", small(DIM, DIM))
        w.add_tensor(f"blk.{i}.attn_k.weight", small(KV_HEADS * head, DIM))
        w.add_tensor(f"blk.{i}.attn_v.weight", small(KV_HEADS * head, DIM))
        w.add_tensor(f"blk.{i}.attn_output.weight", small(DIM, DIM))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(DIM, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", small(FFN, DIM))
        w.add_tensor(f"blk.{i}.ffn_up.weight", small(FFN, DIM))
        w.add_tensor(f"blk.{i}.ffn_down.weight", small(DIM, FFN))
    w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor("output.weight", output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
