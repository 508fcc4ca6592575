"""stagelm's decoder as transformers' Llama state dict, and back: the one map every format goes through.

stagelm's decoder is Llama's: pre-norm RMSNorm, rotate-half RoPE with inverse frequencies
theta^(-2i/d), grouped-query attention, SwiGLU, an optionally tied head. So the map is a
reshape and a transpose per matrix: stagelm keeps q as (D, H, Dh), k and v fused as
(D, 2, K, Dh), gate and up fused as (D, 2, F), and transformers every projection as one
(out, in) matrix. A transformers folder (`hf_import`, `hf_export`) and a GGUF file
(`gguf_import`, `gguf_export`, which renames the tensors for llama.cpp) both go through it.
"""

import dataclasses
import numbers
from collections.abc import Callable
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


# The integer sizes import reads, with the largest value accepted (transformers' names): far above
# any released Llama, and low enough that a wrong value fails here instead of in a huge allocation.
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "intermediate_size": 1 << 20,
    "max_position_embeddings": 1 << 20,
    "head_dim": 1 << 12,
}


def config_int(value: Any, key: str, where: Path, limit: int) -> int:
    """A checkpoint's integer size, or one line naming `key`: an integer (not a bool, a string or a
    float) in [1, limit]. transformers' config.json and GGUF metadata go through it alike."""
    if value is None:
        raise StagelmError(f"{where}: {key} missing; a Llama checkpoint needs it")
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 < value <= limit:
        raise StagelmError(f"{where}: {key} = {shown(value)}; expected an integer in [1, {limit:,}]")
    return int(value)


# The real numbers import reads, each with the largest value accepted (transformers' names): an RMSNorm
# epsilon of 1e300 would flatten every activation to zero, silently.
FLOAT_LIMITS = {"rms_norm_eps": 0.1, "rope_theta": 1e12, "initializer_range": 1.0}


def config_float(value: Any, key: str, where: Path, limit: float = float("inf")) -> float:
    """A checkpoint's positive finite number (RoPE base, RMSNorm epsilon) of at most `limit`, or one
    line naming `key`."""
    if value is None:
        raise StagelmError(f"{where}: {key} missing; a Llama checkpoint needs it")
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise StagelmError(f"{where}: {key} = {shown(value)}; expected a positive number")
    if value > limit:
        raise StagelmError(f"{where}: {key} = {shown(value)}; expected a positive number of at most {limit:g}")
    return float(value)


def shown(value: Any) -> str:
    text = repr(value.item() if isinstance(value, np.generic) else value)
    return text if len(text) <= 40 else text[:40] + "..."


# What sets each dimension of transformers' Llama tensors, by the name a format gives it: the
# config keys an error names when a tensor disagrees with the config.
HF_KEYS = {
    "d": "hidden_size",
    "heads": "num_attention_heads",
    "kv": "num_key_value_heads",
    "ff": "intermediate_size",
    "vocab": "vocab_size",
    "layers": "num_hidden_layers",
    "tie": "tie_word_embeddings",
}
LAYER_SHAPES = {  # transformers' (out, in) layout, in the dimensions above ("qd": heads × head size)
    "input_layernorm.weight": (("d",), ("d",)),
    "post_attention_layernorm.weight": (("d",), ("d",)),
    "self_attn.q_proj.weight": (("heads", "d"), ("heads", "d")),
    "self_attn.k_proj.weight": (("kv", "d"), ("kv", "heads", "d")),
    "self_attn.v_proj.weight": (("kv", "d"), ("kv", "heads", "d")),
    "self_attn.o_proj.weight": (("d", "heads"), ("d", "heads")),
    "mlp.gate_proj.weight": (("ff", "d"), ("ff", "d")),
    "mlp.up_proj.weight": (("ff", "d"), ("ff", "d")),
    "mlp.down_proj.weight": (("d", "ff"), ("d", "ff")),
}
IGNORED = (".rotary_emb.inv_freq",)  # buffers older transformers saved: recomputed, never weights


def expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every tensor a checkpoint of `cfg` must hold: name → (shape, the dimensions' names that set it)."""
    size = {"d": cfg.d_model, "heads": cfg.n_heads * cfg.head_dim, "kv": cfg.n_kv_heads * cfg.head_dim}
    size |= {"ff": cfg.d_ff, "vocab": cfg.vocab_size}
    out = {
        "model.embed_tokens.weight": ((cfg.vocab_size, cfg.d_model), ("vocab", "d")),
        "model.norm.weight": ((cfg.d_model,), ("d",)),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, cfg.d_model), ("vocab", "d", "tie"))
    for i in range(cfg.n_layers):
        for name, (dims, keys) in LAYER_SHAPES.items():
            out[f"model.layers.{i}.{name}"] = (tuple(size[x] for x in dims), keys)
    return out


def check_llama_tensors(
    cfg: DecoderConfig,
    tensors: dict[str, np.ndarray],
    where: Path,
    keys: dict[str, str],
    named: Callable[[str], str] = str,
) -> None:
    """Refuse, in one line naming the config key and the tensor, a checkpoint whose tensors are not
    exactly the decoder `cfg` describes: one missing (a layer count above the weights'), one left
    over (a layer beyond it, a bias, an untied head under tied embeddings), a shape the config
    does not give, integer or boolean values, or a value that is not finite. Runs before anything
    is allocated; transformers folders and GGUF files go through it alike (`keys` names the
    dimensions, and `named` a tensor, in each format's own words)."""
    expected = expected_shapes(cfg)
    for name in tensors:
        if name in expected or name.endswith(IGNORED):
            continue
        if name == "lm_head.weight" and np.array_equal(tensors[name], tensors.get("model.embed_tokens.weight")):
            continue  # a tied head saved as well: the same values
        layer = name.removeprefix("model.layers.").partition(".")[0]
        if name.startswith("model.layers.") and layer.isdigit() and int(layer) >= cfg.n_layers:
            raise StagelmError(
                f"{where}: {keys['layers']} is {cfg.n_layers} but the weights hold {name}; "
                f"set {keys['layers']} to the layers the weights have"
            )
        why = f"{keys['tie']} is true" if name == "lm_head.weight" else "stagelm's decoder has no such weight"
        raise StagelmError(f"{where}: tensor {named(name)} has no place ({why}); refused rather than dropped")
    for name, (shape, dims) in expected.items():
        if name not in tensors:
            if name.startswith("model.layers."):
                raise StagelmError(
                    f"{where}: {keys['layers']} is {cfg.n_layers} but tensor {named(name)} is missing; "
                    f"set {keys['layers']} to the layers the weights have"
                )
            if name == "lm_head.weight":  # asked for by an untied config, absent from the weights
                raise StagelmError(
                    f"{where}: tensor {named(name)} is missing, though {keys['tie']} is false; set it true "
                    "if the output layer shares the embedding's weights"
                )
            raise StagelmError(f"{where}: tensor {named(name)} is missing")
        values = tensors[name]
        if values.shape != shape:
            given = ", ".join(dict.fromkeys(keys[x] for x in dims))
            raise StagelmError(
                f"{where}: tensor {named(name)} has shape {tuple(values.shape)}, but {given} give {shape}; "
                "the config and the weights disagree"
            )
        if not np.issubdtype(values.dtype, np.floating) and values.dtype.name != "bfloat16":
            raise StagelmError(
                f"{where}: tensor {named(name)} is {values.dtype}; stagelm imports floating-point weights"
            )
        if not np.isfinite(values.astype(np.float32, copy=False)).all():  # no copy of float32 weights
            raise StagelmError(f"{where}: tensor {named(name)} holds NaN or infinite values; the checkpoint is damaged")


def decoder_from_llama_tensors(
    cfg: DecoderConfig,
    tensors: dict[str, np.ndarray],
    where: Path,
    vocab_size: int | None = None,
    keys: dict[str, str] | None = None,
    named: Callable[[str], str] = str,
    **settings: Any,
) -> Decoder:
    """A stagelm Decoder holding transformers' Llama state dict `tensors` (name → (out, in) arrays), checked
    first (`check_llama_tensors`). `vocab_size` beyond the checkpoint's grows the embedding (and an untied
    head) for tokens added to its tokenizer, new rows at the mean of the others; `settings` are run settings."""
    check_llama_tensors(cfg, tensors, where, keys or HF_KEYS, named)
    trained_vocab = cfg.vocab_size
    cfg = dataclasses.replace(cfg, vocab_size=max(vocab_size or 0, trained_vocab), **settings)
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff

    def get(name: str) -> np.ndarray:  # present and of its shape: check_llama_tensors said so
        return tensors[name].astype(np.float32, copy=False)

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
