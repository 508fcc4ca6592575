"""The KV cache a decode runs on, in the layout its device writes and reads fastest.

Each layer keeps the keys and values of S slots per row, in one of two layouts
(`default_layout` picks by backend; an array's rank tells which it is):

- heads-major (B, K, S, Dh), off a TPU: a decode step's attention reads it as it lies,
  one small matmul per row and k/v head, with no transposed copy of the cache per layer
  and step (what XLA:CPU runs fastest);
- slot-major (B, S, K·Dh) on a TPU: a slot's k/v heads side by side, so a decode step
  writes one token per row as a contiguous (B, 1, K·Dh) update in place, and
  `slot_major_attention` reads it as it lies (a generation's decode steps: the Pallas kernel of
  `stagelm.model.decode_attention`, which reads only the filled slots' blocks).

Either is pinned to its row-major layout (`pinned`) where it is written and where it is
read. Left to itself, XLA:TPU lays a cache out with the slots minor-most, the layout
q·kᵀ prefers, whatever the logical axis order ((B, K, S, Dh), (B, S, K, Dh), (S, K, B, Dh)
and (B, S, K·Dh) all became slots-minor), and each step's one-token write then rewrote the
whole buffer through a memory-space copy. On a TPU v5e, a decode loop of 30 such attention
layers alone (the SmolLM2-135M shape, batch 256) took 14.6 ms a step with the cache left to
XLA, 5.4 ms pinned heads-major (a 64-wide head fills half of a 128-lane tile) and 3.9 ms
pinned slot-major (benchmarks/README.md, "Decoding on a TPU").
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from stagelm.model.attention_kernels import decode_kernel_for


def pinned(x: jax.Array) -> jax.Array:
    """`x` held in its row-major layout (the last axis minor-most) wherever XLA would choose another.

    Applied to what a write updates and to what attention reads, never to a value a jitted
    function returns: JAX would take it as that output's layout, which a donated cache's
    argument (the default layout) must then match."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def default_layout(backend: str | None = None) -> str:
    """The cache layout a decode on `backend` (default: JAX's) runs fastest with: `slots` on a TPU, else `heads`."""
    return "slots" if (backend or jax.default_backend()) == "tpu" else "heads"


def slot_axis(a: jax.Array) -> int:
    """The slots' axis of a cache array: 2 of heads-major k/v (B, K, S, Dh), 1 of slot-major
    k/v (B, S, K·Dh) and of the segment ids and positions (B, S)."""
    return 2 if a.ndim == 4 else 1


class LayerCache(NamedTuple):
    k: jax.Array  # heads-major (B, K, S, Dh) or slot-major (B, S, K·Dh): the module docstring
    v: jax.Array

    def written(self, k: jax.Array, v: jax.Array, index: jax.Array) -> "LayerCache":
        """This cache with a call's k/v (B, T, K, Dh) at slots [index, index + T): the T new
        tokens are laid out as the cache is, never the cache as they are."""
        b, t = k.shape[:2]

        def write(cache: jax.Array, new: jax.Array) -> jax.Array:
            if cache.ndim == 4:
                new, start = new.transpose(0, 2, 1, 3), (0, 0, index, 0)
            else:
                new, start = new.reshape(b, t, -1), (0, index, 0)
            return jax.lax.dynamic_update_slice(pinned(cache), new.astype(cache.dtype), start)

        return LayerCache(write(self.k, k), write(self.v, v))


class KVCache(NamedTuple):
    """A fixed-capacity cache of S slots: per-layer k/v plus each slot's segment (0 = empty) and position."""

    layers: tuple[LayerCache, ...]
    segment_ids: jax.Array  # (B, S)
    positions: jax.Array  # (B, S)

    def slots_written(self, segment_ids: jax.Array, positions: jax.Array, index: jax.Array) -> tuple:
        """(segment ids, positions) of every slot once a call's (B, T) are written at [index, index + T)."""
        start = (0, index)
        return (
            jax.lax.dynamic_update_slice(self.segment_ids, segment_ids.astype(jnp.int32), start),
            jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32), start),
        )


def init_cache(cfg: Any, batch: int, capacity: int, layout: str | None = None) -> KVCache:
    """An empty cache of `capacity` slots per row for a decoder config (`decoder.DecoderConfig`),
    in `layout` (`heads` or `slots`; default: `default_layout`, or `slots` wherever the config's
    decode steps run the decode kernel, which reads that layout)."""
    layout = layout or ("slots" if decode_kernel_for(cfg.attention) == "decode" else default_layout())
    k, dh = cfg.n_kv_heads, cfg.head_dim
    shape = (batch, k, capacity, dh) if layout == "heads" else (batch, capacity, k * dh)
    layer = LayerCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
    empty = jnp.zeros((batch, capacity), jnp.int32)
    return KVCache(tuple(layer for _ in range(cfg.n_layers)), empty, empty)


def slot_major_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked softmax attention of q (B, T, H, Dh) over a slot-major cache's k, v (B, S, K·Dh);
    mask: (B, 1, T, S) bool → (B, T, H, Dh). Scores and softmax in float32, as
    `decoder.softmax_attention` computes them.

    Each query head's q sits in its k/v head's block of the K·Dh width, zeros in the others,
    so q·kᵀ and weights·v are one plain matmul per row over the slots as they lie. That is K
    times the grouped product's flops, which a TPU's decode step does not notice: it is bound
    by reading the cache and the weights."""
    b, t, h, dh = q.shape
    kh = k.shape[-1] // dh
    eye = jnp.eye(kh, dtype=q.dtype)
    # (B, T, K, G, K', Dh): head (k, g)'s q in block k' = k of the width, zeros in the others.
    q = (q * dh**-0.5).reshape(b, t, kh, h // kh, 1, dh) * eye[:, None, :, None]
    scores = jnp.einsum("bqe,bse->bqs", q.reshape(b, t * h, kh * dh), k).astype(jnp.float32)
    scores = scores.reshape(b, t, h, -1) + jnp.where(mask, 0.0, -1e30)[:, 0, :, None]
    weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = (weights / weights.sum(axis=-1, keepdims=True)).reshape(b, t * h, -1)
    out = jnp.einsum("bqs,bse->bqe", weights.astype(v.dtype), v)  # every head's weights on every k/v head
    # Each head keeps its own block: a product and sum of exact zeros, not a matmul (float32 matmuls
    # on a TPU round to bfloat16 by default).
    out = (out.reshape(b, t, kh, h // kh, kh, dh) * eye[:, None, :, None]).sum(axis=4)
    return out.reshape(b, t, h, dh)
