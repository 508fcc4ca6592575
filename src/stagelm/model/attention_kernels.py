"""Attention kernels for the decoder's training pass: the reference (`decoder.attention`,
written out for XLA, every device) and Pallas splash attention (TPU).

`model.attention` chooses: `auto` takes the device's kernel (splash on a TPU when the rows
are a multiple of its block, else the reference), `reference` and `splash` are explicit,
and an explicit kernel the device lacks is an error, never a quiet switch. Splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) keeps packed documents apart with its
`SegmentIds` and groups query heads over k/v heads natively; within a packed row positions
rise with the index inside each document, so "same segment and not to the right" is
exactly the reference's segment-causal mask. Off a TPU the same kernel runs in Pallas's
interpret mode, which is how the test suite checks it against the reference on a CPU.
A generation's decode steps (one query token per row over the KV cache) follow the same
choice (`decode_kernel_for`): `auto` takes the decode kernel (`stagelm.model.decode_attention`,
which reads only the cache's filled slots) on a TPU and the reference elsewhere, `splash` (the
Pallas kernels) takes it everywhere, interpreted off a TPU, and `reference` never.
"""

import functools
from typing import Any

import jax
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from stagelm.infra.errors import StagelmError
from stagelm.infra.mesh import RULES

BLOCK = 128  # the TPU's lane width: splash's blocks are multiples of it
MAX_BLOCK = 512  # the block size MaxText's splash defaults use for long rows


def kernel_for(choice: str, seq_len: int, backend: str | None = None) -> str:
    """The kernel `model.attention: choice` runs for rows of `seq_len` tokens on `backend`."""
    backend = backend or jax.default_backend()
    if choice == "auto":
        return "splash" if backend == "tpu" and seq_len % BLOCK == 0 else "reference"
    return choice


def decode_kernel_for(choice: str, backend: str | None = None) -> str:
    """The kernel a decode step runs under `model.attention: choice` on `backend`: `decode` (Pallas) or `reference`."""
    backend = backend or jax.default_backend()
    return "decode" if choice == "splash" or (choice == "auto" and backend == "tpu") else "reference"


def require_kernel(choice: str, seq_len: int, key: str = "model.attention") -> None:
    """One line when `choice` cannot run here: splash off a TPU, or rows splash cannot tile."""
    backend = jax.default_backend()
    if choice == "splash" and backend != "tpu":
        raise StagelmError(
            f"{key}: splash is a TPU kernel and this process runs on {backend}; "
            f"set {key}: auto (the device's own kernel) or reference"
        )
    if choice == "splash" and seq_len % BLOCK:
        raise StagelmError(
            f"{key}: splash tiles rows in blocks of {BLOCK} tokens and these rows have {seq_len}; "
            f"use a multiple of {BLOCK} (pack.seq_len) or set {key}: auto"
        )


def block_size(seq_len: int) -> int:
    """The largest block of at most MAX_BLOCK tokens that divides the row (interpret mode takes any)."""
    return next((b for b in (MAX_BLOCK, 256, BLOCK) if seq_len % b == 0), seq_len)


# A tuning: how the kernel tiles rows and runs its backward pass beyond `block_size` and
# `tuning_defaults`, as (name, value) pairs: splash.BlockSizes' fields by name (`fused_bwd` for
# use_fused_bwd_kernel; layouts by QKVLayout's names). `DecoderConfig.splash_tuning` carries one to
# the decoder; benchmarks/accelerator.py --splash measures alternatives on a chip.
Tuning = tuple[tuple[str, Any], ...]


def tuning_defaults(head_dim: int) -> dict:
    """The settings measured fastest on a v5e (docs/accelerators.md): the fused backward pass (dq
    beside dk and dv, one pass over the blocks instead of two) at every shape; k stored with the
    sequence minor where heads are narrower than the 128-wide matrix unit."""
    return {"fused_bwd": 1, **({"k_layout": "SEQ_MINOR"} if head_dim < BLOCK else {})}


@functools.cache
def splash_kernel(seq_len: int, n_heads: int, head_dim: int, interpret: bool, tuning: Tuning = ()):
    """A causal splash kernel over one row: q (H, T, Dh), k and v (K, T, Dh), SegmentIds of (T,)."""
    b = block_size(seq_len)
    options = tuning_defaults(head_dim) | dict(tuning)
    fused = bool(options.pop("fused_bwd"))
    sizes = dict(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b)
    if not fused:  # the fused backward computes dq beside dk and dv, in the dkv kernel's blocks
        sizes |= dict(block_q_dq=b, block_kv_dq=b)
    for key, value in options.items():
        sizes[key] = splash.QKVLayout[value] if key.endswith("_layout") else value
    mask = splash.MultiHeadMask([splash.CausalMask((seq_len, seq_len))] * n_heads)
    # Built once per shape and kept: its mask tables must be constants, not values of the trace
    # that first asked for it.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(
            mask,
            head_shards=1,
            q_seq_shards=1,
            block_sizes=splash.BlockSizes(**sizes, use_fused_bwd_kernel=fused),
            interpret=interpret,
        )


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, tuning: Tuning = ()
) -> jax.Array:
    """Causal attention within segments. q: (B, T, H, Dh); k, v: (B, T, K, Dh); segment_ids:
    (B, T) → (B, T, H, Dh), as `decoder.attention(q, k, v, row_causal_mask(...), causal=True)`,
    the kernel set by `tuning` over `tuning_defaults`. Under a mesh each device runs the kernel on
    its own rows (`shard_map` over the batch axes)."""
    tuning = tuple(sorted(dict(tuning).items()))  # one cached kernel whatever the order given

    def rows(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        _, t, h, dh = q.shape
        kernel = splash_kernel(t, h, dh, jax.default_backend() != "tpu", tuning)
        heads_first = (0, 2, 1, 3)
        out = jax.vmap(kernel)(
            (q * dh**-0.5).transpose(heads_first),
            k.transpose(heads_first),
            v.transpose(heads_first),
            splash.SegmentIds(seg, seg),
        )
        return out.transpose(heads_first)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return rows(q, k, v, segment_ids)
    batch = PartitionSpec(RULES["batch"])
    return jax.shard_map(rows, in_specs=(batch, batch, batch, batch), out_specs=batch, check_vma=False)(
        q, k, v, segment_ids
    )
