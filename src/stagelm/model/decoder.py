"""The decoder: a Llama-style transformer in Flax NNX, read top to bottom.

    norm (RMSNorm) → rope (RoPE) → Projection (a weight, optionally LoRA) → Attention (GQA,
    segment-aware causal) → MLP (SwiGLU) → Block (pre-norm residual) → Decoder (embed, blocks,
    final norm, tied or untied head)

Packed rows hold several documents: `segment_ids` keep a token from attending to
another document and `positions` restart at each document, so a document's logits
inside a packed row equal its logits when run alone.

Every parameter carries logical axis names (`axes` metadata: "vocab", "embed",
"heads", "kv_heads", "head_dim", "mlp", "norm") that `stagelm.infra.mesh` maps onto the
mesh, so the same code runs on one device or shards over data, fsdp and tensor.
Attention and MLP weights are stored per head / fused (q: (D, H, Dh), kv: (D, 2, K, Dh),
gate_up: (D, 2, F)) so that tensor parallelism can split heads and the MLP's hidden
width without mixing q, k and v. Each is a `Projection` (`attn.q.w`, `mlp.down.w`, ...)
named in `config.PROJECTIONS`, so `self.q(x)` reads as the math does.
"""

import dataclasses
import math
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from stagelm.infra.mesh import constrain
from stagelm.model.attention_kernels import BLOCK, Tuning, decode_kernel_for, kernel_for, splash_attention
from stagelm.model.decode_attention import decode_attention
from stagelm.model.kvcache import KVCache, LayerCache, pinned, slot_major_attention
from stagelm.pipeline.config import ModelShape


@dataclasses.dataclass(frozen=True)
class DecoderConfig(ModelShape):
    """The decoder as it runs: the shape params.yaml gives (`config.ModelShape`: model,
    distill.student, benchmark), the vocabulary its tokenizer gives, and the rest."""

    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"
    remat: str = "none"  # none | block | dots: what each block keeps for the backward pass (REMAT_POLICIES)
    attention: str = "auto"  # auto | reference | splash: the training pass's kernel (attention_kernels)
    splash_tuning: Tuning = ()  # the splash kernel's settings over its defaults (attention_kernels.Tuning)
    scan_layers: bool = False  # run the blocks as one jax.lax.scan (compile time independent of depth)
    init_std: float = 0.02
    # LoRA adapters (Hu et al., 2021) on the projections named in lora_targets; rank 0 = none.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def without_lora(self) -> "DecoderConfig":
        return dataclasses.replace(self, lora_rank=0, lora_alpha=0.0, lora_dropout=0.0, lora_targets=())


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, std: float, dtype: Any) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * std, axes=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich, 2019), computed in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class Rotary(NamedTuple):
    """cos and sin of every position's rotary angles, (B, T, 1, Dh/2) float32."""

    cos: jax.Array
    sin: jax.Array


def rotary(positions: jax.Array, head_dim: int, theta: float) -> Rotary:
    """The rotary tables of `positions` (B, T), computed once per forward pass for every layer.

    XLA:CPU fuses an elementwise producer into each of its consumers: cos and sin written
    inline were recomputed per head, per layer, forward and backward. It never fuses a
    gather's table into the gather, so the tables are computed once and each row gathered
    back through an index it cannot fold to the identity (a cumulative sum: an iota it
    folds away). The values are the same bits, and the tiny benchmark step's op time falls
    by about 6% (benchmarks/README.md)."""
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, Dh/2)
    cols = (jnp.cumsum(jnp.ones_like(positions), axis=1) - 1)[..., None]  # 0..T-1 in every row
    cos, sin = (jnp.take_along_axis(table, cols, axis=1) for table in (jnp.cos(angles), jnp.sin(angles)))
    return Rotary(cos[:, :, None, :], sin[:, :, None, :])


def rope(x: jax.Array, rot: Rotary) -> jax.Array:
    """Rotary embedding, rotate-half convention (Su et al., 2021). x: (B, T, H, Dh); rot: `rotary`."""
    half = x.shape[-1] // 2
    cos, sin = rot
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def segment_causal_mask(
    q_segments: jax.Array, kv_segments: jax.Array, q_pos: jax.Array, kv_pos: jax.Array
) -> jax.Array:
    """(B, 1, T, S) bool: a query sees keys of its own segment at or before its position."""
    same = q_segments[:, :, None] == kv_segments[:, None, :]
    causal = kv_pos[:, None, :] <= q_pos[:, :, None]
    return (same & causal)[:, None]


def row_causal_mask(segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """(B, 1, T, T) bool for rows attending to themselves: `segment_causal_mask`, and never a
    key to the right of its query. The same mask for packed rows (positions rise within a
    document); it also keeps padding from looking ahead, so `attention(causal=True)` may
    skip every block above the diagonal."""
    t = segment_ids.shape[1]
    return segment_causal_mask(segment_ids, segment_ids, positions, positions) & jnp.tri(t, dtype=bool)


class Segments(NamedTuple):
    """What a block's attention reads instead of a mask when the splash kernel runs: the row's segment ids (B, T)."""

    ids: jax.Array


@jax.custom_vjp
def softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q·kᵀ masked)·v. q: (B, K, G, T, Dh), already scaled; k, v: (B, K, S, Dh);
    mask: (B, 1, T, S) bool → (B, K, G, T, Dh). Scores and softmax in float32.

    Its backward pass is written out (dS = P ∘ (dO·vᵀ − rowsum(dO ∘ O))), as flash
    attention's is: XLA:CPU's autodiff of the softmax ran about twice as slow
    (benchmarks/README.md). `test_attention_equals_jax_reference` checks both passes."""
    return _attention_forward(q, k, v, mask)[0]


def _attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple:
    b, kh, g, t, dh = q.shape
    # The G query heads of a k/v head are stacked along the query axis: one batched matmul per (B, K).
    scores = jnp.einsum("bkqd,bksd->bkqs", q.reshape(b, kh, g * t, dh), k).astype(jnp.float32)
    bias = jnp.where(mask, 0.0, -1e30)[:, :, None]  # (B, 1, 1, T, S)
    scores = scores.reshape(b, kh, g, t, -1) + bias
    weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = (weights / weights.sum(axis=-1, keepdims=True)).reshape(b, kh, g * t, -1)
    out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(v.dtype), v)
    return out.reshape(q.shape), (q, k, v, weights, out)


def _attention_backward(residuals: tuple, d_out: jax.Array) -> tuple:
    q, k, v, weights, out = residuals
    b, kh, g, t, dh = q.shape
    d_out = d_out.reshape(out.shape)
    dv = jnp.einsum("bkqs,bkqd->bksd", weights.astype(v.dtype), d_out)
    dp = jnp.einsum("bkqd,bksd->bkqs", d_out, v).astype(jnp.float32)
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    ds = (weights * (dp - row)).astype(q.dtype)
    dq = jnp.einsum("bkqs,bksd->bkqd", ds, k).reshape(q.shape)
    dk = jnp.einsum("bkqs,bkqd->bksd", ds, q.reshape(b, kh, g * t, dh))
    return dq, dk, dv, None


softmax_attention.defvjp(_attention_forward, _attention_backward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, causal: bool = False) -> jax.Array:
    """Masked softmax attention with grouped k/v heads.

    q: (B, T, H, Dh); k, v: (B, S, K, Dh) with H = K·G; mask: (B, 1, T, S) bool → (B, T, H, Dh).
    `causal`: q and k/v are the same T rows and `mask` hides every key right of its query
    (`row_causal_mask`); the first half of the queries then attends only to the first half
    of the keys, a quarter of the score matrix never computed. Written out rather than
    `jax.nn.dot_product_attention`, which XLA:CPU runs slower (benchmarks/README.md); the
    test suite checks that both agree.
    """
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, S, Dh)
    return heads_major_attention(q, k, v, mask, causal)


def heads_major_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, causal: bool = False) -> jax.Array:
    """`attention` with k, v already (B, K, S, Dh), a heads-major KV cache's layout (`kvcache`)."""
    b, t, h, dh = q.shape
    kh = k.shape[1]
    q = (q * dh**-0.5).reshape(b, t, kh, h // kh, dh).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, Dh)
    if causal and t >= 2:
        half = t // 2
        first = softmax_attention(q[:, :, :, :half], k[:, :, :half], v[:, :, :half], mask[:, :, :half, :half])
        rest = softmax_attention(q[:, :, :, half:], k, v, mask[:, :, half:])
        y = jnp.concatenate([first, rest], axis=3)
    else:
        y = softmax_attention(q, k, v, mask)
    return y.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def matmul(x: jax.Array, w: jax.Array, in_dims: int = 1) -> jax.Array:
    """`x (..., *w.shape[:in_dims]) @ w` as one 2-D matmul (the layout XLA:CPU runs fastest)."""
    lead = x.shape[: x.ndim - in_dims]
    k = math.prod(w.shape[:in_dims])
    y = x.reshape(-1, k) @ w.reshape(k, -1).astype(x.dtype)
    return y.reshape(*lead, *w.shape[in_dims:])


def halves(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """y[:, :, 0] and y[:, :, 1] of a fused projection's (B, T, 2, ...) output, as the two halves
    of each row's flat product: their gradient is then one concatenation along the minor axis,
    which a TPU lays out with no copy (indexing the axis of 2 cost a layout copy per layer and
    pass, benchmarks/accelerator.py --profile). The same values either way."""
    b, t, _, *rest = y.shape
    first, second = jnp.split(y.reshape(b, t, -1), 2, axis=-1)
    return first.reshape(b, t, *rest), second.reshape(b, t, *rest)


class Projection(nnx.Module):
    """One weight `w` of a block applied as x @ w over w's first `in_dims` axes, plus the
    LoRA adapter on it (`lora`: nnx.LoRA, x·A·B with B starting at zero) when
    `cfg.lora_targets` names it. The projections are named in `config.PROJECTIONS`."""

    def __init__(self, cfg: DecoderConfig, name: str, w: nnx.Param, in_dims: int, rngs: nnx.Rngs):
        self.w, self.in_dims, self.cfg = w, in_dims, cfg
        self.target = name  # its name in config.PROJECTIONS and lora.targets
        fan_in, fan_out = math.prod(w.shape[:in_dims]), math.prod(w.shape[in_dims:])
        targeted = cfg.lora_rank > 0 and name in cfg.lora_targets
        dtype = jnp.dtype(cfg.param_dtype)
        self.lora = nnx.LoRA(fan_in, cfg.lora_rank, fan_out, param_dtype=dtype, rngs=rngs) if targeted else None

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """x @ w, plus (alpha / rank)·dropout(x)·A·B with an adapter (`rng` drives the dropout)."""
        y = matmul(x, self.w[...], self.in_dims)
        if self.lora is None:
            return y
        cfg = self.cfg
        h = x.reshape(-1, math.prod(self.w.shape[: self.in_dims]))
        if rng is not None and cfg.lora_dropout > 0:
            salt = zlib.crc32(self.target.encode())
            keep = jax.random.bernoulli(jax.random.fold_in(rng, salt), 1 - cfg.lora_dropout, h.shape)
            h = jnp.where(keep, h / (1 - cfg.lora_dropout), 0).astype(h.dtype)
        delta = self.lora(h).astype(y.dtype) * (cfg.lora_alpha / cfg.lora_rank)
        return y + delta.reshape(y.shape)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, h, k, dh, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual init
        # Every weight is drawn before any adapter, so a model's weights are the same with or without LoRA.
        q = param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), cfg.init_std, pd)
        kv = param(rngs, (d, 2, k, dh), ("embed", None, "kv_heads", "head_dim"), cfg.init_std, pd)
        o = param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), out_std, pd)
        self.q = Projection(cfg, "q", q, 1, rngs)
        self.kv = Projection(cfg, "kv", kv, 1, rngs)
        self.o = Projection(cfg, "o", o, 2, rngs)
        self.cfg = cfg

    def project_qkv(
        self, x: jax.Array, rot: Rotary, rng: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        q = self.q(x, rng)  # (B, T, H, Dh)
        k, v = halves(self.kv(x, rng))  # (B, T, 2, K, Dh) → two (B, T, K, Dh)
        return rope(q, rot), rope(k, rot), v

    def __call__(
        self, x: jax.Array, rot: Rotary, mask: jax.Array | Segments, rng: jax.Array | None = None
    ) -> jax.Array:
        """Self-attention over the rows: `mask` is the reference kernel's (`row_causal_mask`), or
        the rows' `Segments` for the splash kernel."""
        q, k, v = self.project_qkv(x, rot, rng)
        return self.o(constrain(self.over_rows(q, k, v, mask), ("batch", "seq", "heads", "head_dim")), rng)

    def over_rows(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | Segments) -> jax.Array:
        if isinstance(mask, Segments):
            return splash_attention(q, k, v, mask.ids, self.cfg.splash_tuning)
        return attention(q, k, v, mask, causal=True)

    def prefill(self, x: jax.Array, rot: Rotary, mask: jax.Array | Segments, layer: LayerCache):
        """Attention over this call's T tokens alone, as training computes it, their k/v written at slots [0, T)."""
        q, k, v = self.project_qkv(x, rot)
        return self.o(self.over_rows(q, k, v, mask)), layer.written(k, v, jnp.int32(0))

    def cached(
        self,
        x: jax.Array,
        rot: Rotary,
        mask: jax.Array,
        layer: LayerCache,
        index: jax.Array,
        filled: jax.Array | None = None,
    ):
        """Attend over the cache after writing this call's k/v at slots [index, index + T); `filled`:
        `Decoder.cached`'s."""
        q, k, v = self.project_qkv(x, rot)
        layer = layer.written(k, v, index)
        k, v = pinned(layer.k).astype(x.dtype), pinned(layer.v).astype(x.dtype)
        if filled is not None and q.shape[1] == 1 and k.ndim == 3 and decode_kernel_for(self.cfg.attention) == "decode":
            return self.o(decode_attention(q, k, v, mask, filled)), layer
        read = heads_major_attention if k.ndim == 4 else slot_major_attention  # the cache's layout (kvcache)
        return self.o(read(q, k, v, mask)), layer


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, jnp.dtype(cfg.param_dtype)
        gate_up = param(rngs, (d, 2, f), ("embed", None, "mlp"), cfg.init_std, pd)
        down = param(rngs, (f, d), ("mlp", "embed"), cfg.init_std / math.sqrt(2 * cfg.n_layers), pd)
        self.gate_up = Projection(cfg, "gate_up", gate_up, 1, rngs)
        self.down = Projection(cfg, "down", down, 1, rngs)
        self.cfg = cfg

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        gate, up = halves(self.gate_up(x, rng))  # (B, T, 2, F) → two (B, T, F)
        h = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))  # SwiGLU (Shazeer, 2020)
        return self.down(h, rng)


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.attn_norm = nnx.Param(jnp.ones(cfg.d_model, cfg.param_dtype), axes=("norm",))
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = nnx.Param(jnp.ones(cfg.d_model, cfg.param_dtype), axes=("norm",))
        self.mlp = MLP(cfg, rngs)
        self.eps = cfg.norm_eps

    def __call__(
        self, x: jax.Array, rot: Rotary, mask: jax.Array | Segments, rng: jax.Array | None = None
    ) -> jax.Array:
        attn_rng, mlp_rng = (None, None) if rng is None else jax.random.split(rng)
        x = x + self.attn(rms_norm(x, self.attn_norm[...], self.eps), rot, mask, attn_rng)
        x = x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps), mlp_rng)
        return constrain(x, ("batch", "seq", "embed_act"))

    def cached(
        self,
        x: jax.Array,
        rot: Rotary,
        mask: jax.Array,
        layer: LayerCache,
        index: jax.Array,
        filled: jax.Array | None = None,
    ):
        y, layer = self.attn.cached(rms_norm(x, self.attn_norm[...], self.eps), rot, mask, layer, index, filled)
        x = x + y
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps)), layer

    def prefill(self, x: jax.Array, rot: Rotary, mask: jax.Array | Segments, layer: LayerCache):
        y, layer = self.attn.prefill(rms_norm(x, self.attn_norm[...], self.eps), rot, mask, layer)
        x = x + y
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps)), layer


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, pd)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = nnx.Param(jnp.ones(cfg.d_model, pd), axes=("norm",))
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """(B, T, D) embeddings. The table's fsdp shards are gathered before the lookup, as FSDP
        does for every weight it uses, so the rows come out split by batch rather than by
        feature (GSPMD would otherwise replicate them to reshard)."""
        table = constrain(self.embed[...], ("vocab", None))
        return constrain(table.astype(self.cfg.dtype)[tokens], ("batch", "seq", "embed_act"))

    def row_mask(self, segment_ids: jax.Array, positions: jax.Array, prompt: bool = False) -> jax.Array | Segments:
        """What attention over rows of tokens reads: their `Segments` for the splash kernel, else
        the reference kernel's mask (`row_causal_mask`). A `prompt` (a prefill's rows, of any
        width) takes splash only where its blocks tile the rows."""
        t = segment_ids.shape[1]
        if kernel_for(self.cfg.attention, t) == "splash" and not (prompt and t % BLOCK):
            return Segments(segment_ids)
        return row_causal_mask(segment_ids, positions)

    def hidden(
        self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array, rng: jax.Array | None = None
    ) -> jax.Array:
        """Final-norm hidden states (B, T, D) of token rows (B, T); `rng` drives LoRA dropout when set."""
        x = self.embed_tokens(tokens)
        mask = self.row_mask(segment_ids, positions)
        rot = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        keys = [None if rng is None else jax.random.fold_in(rng, i) for i in range(len(self.blocks))]
        if self.cfg.scan_layers:
            x = scan_blocks(self.blocks, x, rot, mask, keys, self.cfg.remat)
        else:
            for block, key in zip(self.blocks, keys, strict=True):
                if self.cfg.remat == "none":
                    x = block(x, rot, mask, key)
                else:
                    x = nnx.remat(lambda b, x, key: b(x, rot, mask, key), policy=REMAT_POLICIES[self.cfg.remat])(
                        block, x, key
                    )
        return rms_norm(x, self.final_norm[...], self.cfg.norm_eps)

    def logits(self, h: jax.Array) -> jax.Array:
        w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        return h @ w.astype(h.dtype)  # (B, T, V)

    def __call__(
        self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array, rng: jax.Array | None = None
    ) -> jax.Array:
        return self.logits(self.hidden(tokens, segment_ids, positions, rng))

    def cached(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        index: jax.Array,
        filled: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """(logits (B, T, V), cache) for tokens written at cache slots [index, index + T).

        The cache remembers each slot's segment and position, so the same
        segment-aware causal mask as training applies: rows may be left-padded
        (segment 0) and carry their own positions. `filled`, where the caller knows it (a
        generation fills its slots in order, `infer.generate`): every slot from it on is empty,
        and a decode step that runs the decode kernel (`attention_kernels.decode_kernel_for`)
        reads only the slots before it.
        """
        seg, pos = cache.slots_written(segment_ids, positions, index)
        mask = segment_causal_mask(segment_ids, seg, positions, pos)
        x = self.embed_tokens(tokens)
        rot = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        layers = []
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            x, layer = block.cached(x, rot, mask, layer, index, filled)
            layers.append(layer)
        h = rms_norm(x, self.final_norm[...], self.cfg.norm_eps)
        return self.logits(h), KVCache(tuple(layers), seg, pos)

    def prefill(
        self, tokens: jax.Array, segment_ids: jax.Array, positions: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """(the last position's logits (B, 1, V), cache) for prompt rows (B, T) written at cache slots
        [0, T): `cached` at index 0, computed as training computes the rows (attention over the
        T tokens alone, causal halves or the splash kernel, not over every slot of the cache) and
        with only the logits a generation reads."""
        seg, pos = cache.slots_written(segment_ids, positions, jnp.int32(0))
        x = self.embed_tokens(tokens)
        mask = self.row_mask(segment_ids, positions, prompt=True)
        rot = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)
        layers = []
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            x, layer = block.prefill(x, rot, mask, layer)
            layers.append(layer)
        h = rms_norm(x[:, -1:], self.final_norm[...], self.cfg.norm_eps)
        return self.logits(h), KVCache(tuple(layers), seg, pos)


# What a block keeps for the backward pass (`model.remat`): `none` keeps every activation,
# `block` nothing (each block recomputed, what MaxText calls full), `dots` the outputs of the
# projections (matmuls without batch dimensions), so the backward pass recomputes only the
# cheap elementwise work and attention.
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def scan_blocks(
    blocks: nnx.List, x: jax.Array, rot: Rotary, mask: jax.Array | Segments, keys: list, remat: str
) -> jax.Array:
    """The blocks as one `jax.lax.scan` over their stacked weights: XLA compiles one block, not
    n_layers of them. The weights stay one module per block (the model folder, LoRA, the KV
    cache and export see no difference); the stack is built inside the step, and its gradient
    flows back to each block's own weights."""
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *[nnx.state(b) for b in blocks])
    keyed = keys[0] is not None
    stacked_keys = jnp.stack(keys) if keyed else jnp.zeros(len(keys))

    def body(x: jax.Array, layer: tuple) -> tuple[jax.Array, None]:
        state, key = layer
        return nnx.merge(graphdef, state)(x, rot, mask, key if keyed else None), None

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, x, (stacked, stacked_keys))[0]


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def flops_per_token(cfg: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token, MaxText's count (`calculate_tflops_training_per_device`):
    6·N for the matmul parameters, the unembedding included, plus 6·L·S·H·Dh for attention's
    two products (2·2·S·H·Dh forward, twice that backward) with the causal half removed.
    stagelm's MFU everywhere (pretrain's log, the benchmark stage, benchmarks/accelerator.py)
    is this count over the device's peak."""
    d, dh = cfg.d_model, cfg.head_dim
    per_layer = 2 * d * cfg.n_heads * dh + 2 * d * cfg.n_kv_heads * dh + 3 * d * cfg.d_ff
    matmul_params = cfg.n_layers * per_layer + cfg.vocab_size * d
    return 6 * matmul_params + 6 * cfg.n_layers * seq_len * cfg.n_heads * dh
