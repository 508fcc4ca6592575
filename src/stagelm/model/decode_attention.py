"""Decode attention on a TPU: one query token per row over a slot-major KV cache, reading only
the slots a generation has filled (a Pallas kernel; Pallas's interpret mode off a TPU, which is
how the tests check it against the reference on a CPU).

A generation's cache fills its slots in order, the same slot of every row at each step
(`stagelm.infer.generate`: left-padded prompts at [0, width), then one slot a step), so at a
step writing slot i every row's visible keys lie in slots [0, i]. XLA's attention
(`kvcache.slot_major_attention`) reads all S slots of the cache, the empty ones too; at a batch
of 256 on a v5e that was 71% of a decode's device time (benchmarks/README.md, "Decoding on a
TPU"). This kernel walks the slots in blocks, flash-decoding style (an online softmax over the
blocks, Dao et al. 2022), and the blocks past the filled ones are neither fetched (their block
index repeats the last filled one's, which Pallas does not fetch again) nor computed.

Each grid step takes a block of R rows and a block of slots, and flattens the rows into one
matmul each way (`_kernel`). The matmuls are those of `slot_major_attention`: each query head's
q sits in its k/v head's block of the K·Dh width (zeros in the others), so q·kᵀ and weights·v
are plain matmuls over the slots as they lie, and each head keeps its own block of the output
afterwards. The mask enters as an additive bias, as in the reference; scores and softmax in
float32.

The blocks were measured on a v5e (benchmarks/decode_kernel.py: 30 layers of attention at the
SmolLM2-135M shape, 256 slots of which 192 filled; benchmarks/README.md): grid steps cost more
than the slots they skip. At a batch of 256, 8 rows by 256 slots took 2.8 ms against XLA's 3.9;
8 rows by 64 slots (reading 3 of the 4 blocks) 4.0, by 128 3.7; 16 rows by 256, 3.4
(each slot's scores are computed for all R rows' heads, so R costs vector work). So the defaults
read whole 256-slot blocks: at a cache of 256 slots every slot is read, and the skipping of
empty blocks pays only in larger caches.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SLOT_BLOCK = 256  # slots a grid step reads: the granularity of "only the filled slots"
ROW_BLOCK = 8  # rows a grid step reads at most (a divisor of the batch)
LANES = 128  # the softmax's running max and sum are kept lane-wide, as Pallas's TPU kernels keep them
# How the kernel gets its slots: `blocks`, BlockSpecs of ROW_BLOCK rows by SLOT_BLOCK slots (Pallas
# pipelines them); `prefix`, a grid step per block of rows that fetches the filled chunks of
# SLOT_BLOCK slots itself, the next block's while this one computes (`_prefix_kernel`). On a v5e
# (benchmarks/decode_kernel.py, 192 of 256 slots filled, batch 256) prefix in chunks of 64 took
# 3.7 ms and of 128 3.6, against blocks of 8 × 256's 2.7: its chunks' smaller matmuls cost more
# than the quarter of the bytes they skip.
FETCH = "blocks"
PREFIX_VMEM = 8 << 20  # the most the prefix fetch's two buffers of k and v may take (else: blocks)
MASKED = -1e30  # the reference's bias for a masked slot (kvcache.slot_major_attention)


def row_block(batch: int, most: int = ROW_BLOCK) -> int:
    """The largest divisor of `batch` of at most `most` rows."""
    return max(r for r in range(1, min(batch, most) + 1) if batch % r == 0)


def _update(q, k, v, bias, m_ref, l_ref, acc_ref) -> None:
    """The online softmax's step over one block of slots: q (M, E), k and v (R·s, E), bias (M, R·s)."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) + bias
    m_prev = m_ref[...]  # (M, LANES), every lane the same
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new[:, :1])
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=-1, keepdims=True)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # (M, E)
    acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv
    m_ref[...] = m_new


def _start(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _kernel(filled_ref, q_ref, own_ref, bias_ref, k_ref, v_ref, out_ref, m_ref, l_ref, acc_ref, *, slot_block: int):
    """One (rows, slots) block: q (1, M, E) (the R rows' query heads, flattened), own (M, R·s), bias
    (1, 1, 1, R·s), k and v (R, s, E); out (1, M, E) float32.

    The block's rows are flattened into one matmul each way, (M, E)·(R·s, E)ᵀ and (M, R·s)·(R·s, E):
    a TPU's matrix unit costs the same per slot whether a product is one row's or the block's, and
    one large product keeps its units busy where R small ones, each waiting on its softmax, did
    not. `own` masks a head's scores against the other rows' slots, so its weights there are exact
    zeros."""
    j = pl.program_id(1)
    rows, _, e = k_ref.shape

    pl.when(j == 0)(lambda: _start(m_ref, l_ref, acc_ref))

    @pl.when(j * slot_block < filled_ref[0])
    def _block():
        k, v = (ref[...].reshape(rows * slot_block, e) for ref in (k_ref, v_ref))
        _update(q_ref[0], k, v, own_ref[...] + bias_ref[0, 0], m_ref, l_ref, acc_ref)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        out_ref[0] = acc_ref[...] / l_ref[...][:, :1]


@functools.partial(jax.jit, static_argnames=("slot_block", "interpret"))
def _call(
    q: jax.Array,
    own: jax.Array,
    bias: jax.Array,
    k: jax.Array,
    v: jax.Array,
    filled: jax.Array,
    slot_block: int,
    interpret: bool,
) -> jax.Array:
    """q (B/R, M, E), own (M, R·s), bias (B/R, S/s, 1, R·s), k and v (B, S, E) → (B/R, M, E) float32."""
    blocks, (m, e), rows = k.shape[1] // slot_block, q.shape[1:], own.shape[1] // slot_block

    def live(j, filled_ref):  # the last filled block for every block past it: fetched once
        return jnp.minimum(j, jnp.maximum(filled_ref[0] - 1, 0) // slot_block)

    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(q.shape[0], blocks),
        in_specs=[
            pl.BlockSpec((1, m, e), lambda i, j, f: (i, 0, 0)),
            pl.BlockSpec(own.shape, lambda i, j, f: (0, 0)),  # the same block throughout: fetched once
            pl.BlockSpec((1, 1, 1, rows * slot_block), lambda i, j, f: (i, live(j, f), 0, 0)),
            pl.BlockSpec((rows, slot_block, e), lambda i, j, f: (i, live(j, f), 0)),
            pl.BlockSpec((rows, slot_block, e), lambda i, j, f: (i, live(j, f), 0)),
        ],
        out_specs=pl.BlockSpec((1, m, e), lambda i, j, f: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((m, LANES), jnp.float32)] * 2 + [pltpu.VMEM((m, e), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, slot_block=slot_block),
        grid_spec=grid,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(filled.reshape(1).astype(jnp.int32), q, own, bias, k, v)


def _prefix_kernel(
    filled_ref, q_ref, own_ref, bias_ref, k_hbm, v_hbm, out_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref
):
    """One block of R rows, all its slots at once, fetched by the kernel itself: only the chunks of
    slots holding anything (`filled`), each row block's while the one before it computes. q (1, M, E),
    own (M, R·c), bias (1, S/c, 1, R·c), k and v (B, S, E) in HBM; kbuf and vbuf (2, R, S, E)."""
    i, blocks, filled = pl.program_id(0), pl.num_programs(0), filled_ref[0]
    rows, chunk = kbuf.shape[1], own_ref.shape[1] // kbuf.shape[1]
    chunks, e = kbuf.shape[2] // chunk, kbuf.shape[3]

    def each_filled(block, slot, act):  # act on the DMA of each filled chunk of `block` into buffer `slot`
        for c in range(chunks):
            for w, (hbm, buf) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
                where = (pl.ds(block * rows, rows), pl.ds(c * chunk, chunk))
                copy = pltpu.make_async_copy(hbm.at[where], buf.at[slot, :, pl.ds(c * chunk, chunk)], sems.at[slot, w])
                pl.when(c * chunk < filled)(functools.partial(act, copy))

    slot = i % 2
    pl.when(i == 0)(lambda: each_filled(0, 0, lambda copy: copy.start()))
    each_filled(i, slot, lambda copy: copy.wait())
    pl.when(i + 1 < blocks)(lambda: each_filled(i + 1, 1 - slot, lambda copy: copy.start()))
    _start(m_ref, l_ref, acc_ref)
    for c in range(chunks):

        @pl.when(c * chunk < filled)
        def _chunk(c=c):
            k, v = (buf[slot, :, pl.ds(c * chunk, chunk)].reshape(rows * chunk, e) for buf in (kbuf, vbuf))
            _update(q_ref[0], k, v, own_ref[...] + bias_ref[0, c], m_ref, l_ref, acc_ref)

    out_ref[0] = acc_ref[...] / l_ref[...][:, :1]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _prefix_call(
    q: jax.Array, own: jax.Array, bias: jax.Array, k: jax.Array, v: jax.Array, filled: jax.Array, interpret: bool
) -> jax.Array:
    """`_call` with the kernel fetching its rows' filled chunks itself (`_prefix_kernel`); own (M, R·c)."""
    (m, e), rows, (s, chunks) = q.shape[1:], k.shape[0] // q.shape[0], (k.shape[1], bias.shape[1])
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(q.shape[0],),
        in_specs=[
            pl.BlockSpec((1, m, e), lambda i, f: (i, 0, 0)),
            pl.BlockSpec(own.shape, lambda i, f: (0, 0)),
            pl.BlockSpec((1, chunks, 1, own.shape[1]), lambda i, f: (i, 0, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((1, m, e), lambda i, f: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, rows, s, e), k.dtype)] * 2
        + [pltpu.SemaphoreType.DMA((2, 2))]
        + [pltpu.VMEM((m, LANES), jnp.float32)] * 2
        + [pltpu.VMEM((m, e), jnp.float32)],
    )
    return pl.pallas_call(
        _prefix_kernel,
        grid_spec=grid,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(filled.reshape(1).astype(jnp.int32), q, own, bias, k, v)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    filled: jax.Array,
    slot_block: int | None = None,
    rows: int | None = None,
) -> jax.Array:
    """`kvcache.slot_major_attention(q, k, v, mask)` for one query token per row, reading only slots
    [0, filled). q: (B, 1, H, Dh); k, v: (B, S, K·Dh); mask: (B, 1, 1, S) bool, no slot at or past
    `filled` visible → (B, 1, H, Dh). Slots are read in blocks of `slot_block` (one block where S is
    no larger), or of the largest of 128, 64, 32 or 16 that divides S where it does not (else one
    block of S); rows in blocks of a divisor of B up to `rows` (default: SLOT_BLOCK and ROW_BLOCK,
    read at the call: benchmarks/decode_profile.py --blocks)."""
    b, t, h, dh = q.shape
    s, e = k.shape[1:]
    kh = e // dh
    slot_block = slot_block or SLOT_BLOCK
    slot_block = s if s <= slot_block else next((n for n in (slot_block, 128, 64, 32, 16) if s % n == 0), s)
    rows = row_block(b, rows or ROW_BLOCK)
    m = -(-rows * h // 16) * 16  # the block's query heads, padded to whole bfloat16 sublane tiles
    eye = jnp.eye(kh, dtype=q.dtype)
    # (B, K, G, K', Dh): head (k, g)'s q in block k' = k of the width, zeros in the others.
    wide = ((q[:, 0] * dh**-0.5).reshape(b, kh, h // kh, 1, dh) * eye[:, None, :, None]).reshape(b // rows, rows * h, e)
    wide = jnp.pad(wide, ((0, 0), (0, m - rows * h), (0, 0)))
    # A head's own row's slots (the rows' slots side by side, as the kernel flattens them), as a bias.
    head_row = jnp.minimum(jnp.arange(m) // h, rows)  # padding heads: a row of their own, no slot
    own = jnp.where(head_row[:, None] == jnp.arange(rows * slot_block)[None] // slot_block, 0.0, MASKED)
    # (B/R, S/s, 1, R·s): each block's mask as a bias, its rows' slots side by side.
    bias = jnp.where(mask[:, 0, 0], 0.0, MASKED).astype(jnp.float32)
    bias = bias.reshape(b // rows, rows, s // slot_block, slot_block).transpose(0, 2, 1, 3)
    bias = bias.reshape(b // rows, s // slot_block, 1, rows * slot_block)
    interpret = jax.default_backend() != "tpu"
    filled = jnp.asarray(filled)
    lanes = -(-e // LANES) * LANES
    if FETCH == "prefix" and 2 * 2 * rows * s * lanes * k.dtype.itemsize <= PREFIX_VMEM:
        out = _prefix_call(wide, own.astype(jnp.float32), bias, k, v, filled, interpret)
    else:
        out = _call(wide, own.astype(jnp.float32), bias, k, v, filled, slot_block, interpret)
    # Each head keeps its own k/v head's block of the width.
    out = out[:, : rows * h].reshape(b, kh, h // kh, kh, dh) * eye[:, None, :, None].astype(out.dtype)
    return out.sum(axis=3).reshape(b, t, h, dh).astype(q.dtype)
