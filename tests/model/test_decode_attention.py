"""The decode-attention kernel (Pallas, run here in interpret mode) against the reference cached
attention, a decoder's cached steps with it against the full forward pass, and its choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stagelm.model import decode_attention as decode_attention_module
from stagelm.model.attention_kernels import decode_kernel_for
from stagelm.model.decode_attention import decode_attention, row_block
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.kvcache import init_cache, slot_major_attention

CFG = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.2)


def cache_rows(batch: int, slots: int, heads: int, kv_heads: int, head_dim: int, filled: int) -> tuple:
    """q, k, v and a (B, 1, 1, S) mask: rows left-padded by different widths, nothing visible from
    `filled` on, and NaN in every slot block past the one `filled` ends in (none of it may be read)."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, 1, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, slots, kv_heads * head_dim)) for key in keys[1:])
    pad = np.arange(batch) * 7 % (filled - 1)
    visible = (np.arange(slots)[None] >= pad[:, None]) & (np.arange(slots)[None] < filled)
    return q, k, v, jnp.asarray(visible)[:, None, None, :]


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "head_dim", "rows", "slot_block", "filled"),
    [
        (6, 9, 3, 16, 4, 16, 40),  # SmolLM2's grouping (9 over 3); rows in blocks of 3
        (8, 4, 2, 8, 4, 16, 64),  # every slot filled
        (5, 4, 4, 8, 8, 32, 17),  # one row block of 5, the filled slots ending inside a block
        (3, 6, 1, 8, 2, 64, 30),  # the slots in one block
    ],
)
@pytest.mark.parametrize("fetch", ["prefix", "blocks"])
def test_the_kernel_equals_the_reference_and_reads_only_filled_blocks(
    batch, heads, kv_heads, head_dim, rows, slot_block, filled, fetch, monkeypatch
):
    """Both ways of fetching the slots: the kernel's own DMAs of the filled chunks, and BlockSpecs."""
    monkeypatch.setattr(decode_attention_module, "FETCH", fetch)
    q, k, v, mask = cache_rows(batch, 64, heads, kv_heads, head_dim, filled)
    want = slot_major_attention(q, k, v, mask)
    past = -(-filled // slot_block) * slot_block  # the first slot of the first block wholly past `filled`
    k, v = (x.at[:, past:].set(jnp.nan) for x in (k, v))
    got = decode_attention(q, k, v, mask, jnp.int32(filled), slot_block, rows)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_kernel_in_bfloat16_is_the_reference_within_its_rounding():
    q, k, v, mask = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in cache_rows(8, 64, 9, 3, 16, 50))
    got = decode_attention(q, k, v, mask, jnp.int32(50), 16, 4).astype(jnp.float32)
    np.testing.assert_allclose(got, slot_major_attention(q, k, v, mask).astype(jnp.float32), atol=2e-2)


def test_row_blocks_divide_the_batch():
    assert [row_block(b, 8) for b in (1, 6, 8, 12, 256, 7)] == [1, 6, 8, 6, 8, 7]


def test_the_decode_kernel_choice():
    assert decode_kernel_for("auto", "tpu") == "decode"
    assert decode_kernel_for("auto", "cpu") == "reference"
    assert decode_kernel_for("splash", "cpu") == "decode"  # the Pallas kernels, interpreted off a TPU
    assert decode_kernel_for("reference", "tpu") == "reference"


def test_cached_steps_with_the_kernel_equal_the_full_forward_pass():
    """`Decoder.cached` told the filled slots runs the kernel (`model.attention: splash`, the Pallas
    kernels, on a slot-major cache): two rows, the second left-padded by five slots, each step's
    logits those of the whole row run at once by the reference."""
    model = Decoder(dataclasses.replace(CFG, attention="splash"), nnx.Rngs(0))
    reference = Decoder(dataclasses.replace(CFG, attention="reference"), nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 16)), jnp.int32)
    seg = jnp.ones((2, 16), jnp.int32).at[1, :5].set(0)
    pos = jnp.stack([jnp.arange(16), jnp.maximum(jnp.arange(16) - 5, 0)]).astype(jnp.int32)
    full = reference(tokens, seg, pos)
    cache = init_cache(model.cfg, 2, 32)
    assert cache.layers[0].k.ndim == 3  # the kernel's slot-major layout, chosen by the config
    logits, cache = model.prefill(tokens[:, :12], seg[:, :12], pos[:, :12], cache)
    for i in range(12, 16):
        at = (slice(None), slice(i, i + 1))
        logits, cache = model.cached(tokens[at], seg[at], pos[at], cache, jnp.int32(i), filled=jnp.int32(i + 1))
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=2e-5, rtol=1e-5)
