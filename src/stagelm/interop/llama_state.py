"""stagelm's decoder as transformers' Llama state dict, and back: the one map every format goes through.

stagelm's decoder is Llama's: pre-norm RMSNorm, rotate-half RoPE with inverse frequencies
theta^(-2i/d), grouped-query attention, SwiGLU, an optionally tied head. So the map is a
reshape and a transpose per matrix: stagelm keeps q as (D, H, Dh), k and v fused as
(D, 2, K, Dh), gate and up fused as (D, 2, F), and transformers every projection as one
(out, in) matrix. A transformers folder (`hf_import`, `hf_export`) and a GGUF file
(`gguf_import`, `gguf_export`, which renames the tensors for llama.cpp) both go through it.
"""

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from stagelm.infra.errors import StagelmError
from stagelm.model.decoder import Decoder, DecoderConfig


def llama_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """transformers' Llama state dict (name → (out, in) float arrays) of a stagelm decoder."""
    cfg = model.cfg
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    out = {"model.embed_tokens.weight": np.asarray(model.embed[...])}
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        kv = np.asarray(block.attn.kv.w[...])
        gate_up = np.asarray(block.mlp.gate_up.w[...])
        out.update(
            {
                p + "input_layernorm.weight": np.asarray(block.attn_norm[...]),
                p + "post_attention_layernorm.weight": np.asarray(block.mlp_norm[...]),
                p + "self_attn.q_proj.weight": np.asarray(block.attn.q.w[...]).reshape(d, h * dh).T,
                p + "self_attn.k_proj.weight": kv[:, 0].reshape(d, k * dh).T,
                p + "self_attn.v_proj.weight": kv[:, 1].reshape(d, k * dh).T,
                p + "self_attn.o_proj.weight": np.asarray(block.attn.o.w[...]).reshape(h * dh, d).T,
                p + "mlp.gate_proj.weight": gate_up[:, 0].T,
                p + "mlp.up_proj.weight": gate_up[:, 1].T,
                p + "mlp.down_proj.weight": np.asarray(block.mlp.down.w[...]).T.reshape(d, f),
            }
        )
    out["model.norm.weight"] = np.asarray(model.final_norm[...])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(model.head[...]).T
    return {name: np.ascontiguousarray(a) for name, a in out.items()}


def decoder_from_llama_tensors(
    cfg: DecoderConfig, tensors: dict[str, np.ndarray], where: Path, vocab_size: int | None = None, **settings: Any
) -> Decoder:
    """A stagelm Decoder holding transformers' Llama state dict `tensors` (name → (out, in) arrays).

    `vocab_size` beyond the checkpoint's grows the embedding (and an untied head) for tokens
    added to its tokenizer; their rows start at the mean of the existing ones. `settings` are
    DecoderConfig fields that do not change the weights (dtype, param_dtype, remat)."""
    trained_vocab = cfg.vocab_size
    cfg = dataclasses.replace(cfg, vocab_size=max(vocab_size or 0, trained_vocab), **settings)
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise StagelmError(f"{where}: weight {name} missing")
        return tensors[name].astype(np.float32)

    def grown(rows: np.ndarray) -> np.ndarray:  # (trained vocab, d) → (cfg.vocab_size, d)
        if len(rows) != trained_vocab:
            return rows  # a wrong shape is named below
        extra = np.repeat(rows.mean(0, keepdims=True), cfg.vocab_size - trained_vocab, axis=0)
        return np.concatenate([rows, extra])

    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    values = {("embed",): grown(get("model.embed_tokens.weight")), ("final_norm",): get("model.norm.weight")}
    if not cfg.tie_embeddings:
        values[("head",)] = grown(get("lm_head.weight")).T
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        q = get(p + "self_attn.q_proj.weight").T.reshape(d, h, dh)
        kk = get(p + "self_attn.k_proj.weight").T.reshape(d, k, dh)
        v = get(p + "self_attn.v_proj.weight").T.reshape(d, k, dh)
        values.update(
            {
                ("blocks", i, "attn_norm"): get(p + "input_layernorm.weight"),
                ("blocks", i, "mlp_norm"): get(p + "post_attention_layernorm.weight"),
                ("blocks", i, "attn", "q", "w"): q,
                ("blocks", i, "attn", "kv", "w"): np.stack([kk, v], axis=1),
                ("blocks", i, "attn", "o", "w"): get(p + "self_attn.o_proj.weight").T.reshape(h, dh, d),
                ("blocks", i, "mlp", "gate_up", "w"): np.stack(
                    [get(p + "mlp.gate_proj.weight").T, get(p + "mlp.up_proj.weight").T], axis=1
                ),
                ("blocks", i, "mlp", "down", "w"): get(p + "mlp.down_proj.weight").T.reshape(f, d),
            }
        )
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, variable in flat.items():
        name = ".".join(map(str, path))
        if path not in values:
            raise StagelmError(f"{where}: no weight maps to stagelm parameter {name}")
        if values[path].shape != variable.shape:
            raise StagelmError(f"{where}: weight for {name} has shape {values[path].shape}, expected {variable.shape}")
        flat[path] = variable.replace(jax.numpy.asarray(values[path], variable.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
