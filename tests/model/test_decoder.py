"""The decoder: packing-aware attention, GQA, remat and the tied head behave as specified."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import forward
from flax import nnx

from stagelm.model.decoder import Decoder, DecoderConfig, Projection, count_params, flops_per_token, rope, rotary
from stagelm.pipeline.config import PROJECTIONS

CFG = DecoderConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


def run(model, tokens, segments=None, positions=None):
    """The logits of one row (T,)."""
    tokens = jnp.asarray(tokens)[None]
    segments = jnp.ones_like(tokens) if segments is None else jnp.asarray(segments)[None]
    positions = jnp.arange(tokens.shape[1])[None] if positions is None else jnp.asarray(positions)[None]
    return forward(model, tokens, segments, positions)[0]


def test_document_in_a_packed_row_equals_document_alone():
    model = Decoder(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, 97, n) for n in (5, 7, 4))
    row = np.concatenate([a, b, c, [0, 0]])
    seg = np.array([1] * 5 + [2] * 7 + [3] * 4 + [0, 0])
    pos = np.concatenate([np.arange(5), np.arange(7), np.arange(4), [0, 0]])
    packed = run(model, row, seg, pos)
    np.testing.assert_allclose(packed[5:12], run(model, b), atol=1e-5)
    np.testing.assert_allclose(packed[12:16], run(model, c), atol=1e-5)
    np.testing.assert_allclose(packed[:5], run(model, a), atol=1e-5)


def test_causal_future_tokens_do_not_change_the_past():
    model = Decoder(CFG, nnx.Rngs(1))
    x = np.arange(3, 15)
    y = x.copy()
    y[8:] = 50
    np.testing.assert_allclose(run(model, x)[:8], run(model, y)[:8], atol=1e-6)
    assert not np.allclose(run(model, x)[8:], run(model, y)[8:])


def test_rope_is_relative():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    @jax.jit
    def dot(i, j):
        return jnp.sum(rope(q, rotary(i[None, None], 8, 1e4)) * rope(k, rotary(j[None, None], 8, 1e4)))

    def score(i, j):
        return float(dot(jnp.int32(i), jnp.int32(j)))

    assert score(7, 3) == pytest.approx(score(14, 10), abs=1e-5)


def test_remat_changes_memory_not_math():
    model = Decoder(CFG, nnx.Rngs(2))
    remat = Decoder(DecoderConfig(**{**CFG.__dict__, "remat": "block"}), nnx.Rngs(2))
    x = jnp.arange(3, 19)[None]
    seg, pos = jnp.ones_like(x), jnp.arange(16)[None]

    def loss(m):
        return jnp.mean(m(x, seg, pos) ** 2)

    grad = nnx.jit(nnx.grad(loss))  # jitted, where the checkpoint policy shapes the compiled backward pass
    g1, g2 = grad(model), grad(remat)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_untied_head_and_param_count():
    tied = Decoder(CFG, nnx.Rngs(0))
    untied = Decoder(DecoderConfig(**{**CFG.__dict__, "tie_embeddings": False}), nnx.Rngs(0))
    assert count_params(untied) - count_params(tied) == CFG.vocab_size * CFG.d_model
    d, dh = 32, 8
    per_layer = d * 4 * dh + d * 2 * 2 * dh + 4 * dh * d + 3 * d * 64 + 2 * d
    assert count_params(tied) == 2 * per_layer + 97 * d + d
    # MaxText's count: 6 per matmul parameter (the tied unembedding included, the norms not) and
    # attention's 4·S·H·Dh forward, tripled for the backward pass, halved for the causal mask
    attention = 4 * 16 * 4 * dh * 3 / 2
    assert flops_per_token(CFG, 16) == 6 * (2 * (per_layer - 2 * d) + 97 * d) + 2 * attention


def test_bfloat16_compute_stays_close_to_float32():
    model = Decoder(CFG, nnx.Rngs(3))
    low = Decoder(DecoderConfig(**{**CFG.__dict__, "dtype": "bfloat16"}), nnx.Rngs(3))
    x = np.arange(3, 19)
    hi, lo = run(model, x), run(low, x).astype(jnp.float32)
    assert lo.dtype == jnp.float32 and float(jnp.max(jnp.abs(hi - lo))) < 0.05


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_attention_equals_jax_reference(heads, kv_heads):
    from stagelm.model.decoder import attention, segment_causal_mask

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 10, heads, 8))
    k = jax.random.normal(keys[1], (2, 10, kv_heads, 8))
    v = jax.random.normal(keys[2], (2, 10, kv_heads, 8))
    seg = jnp.array([[1] * 4 + [2] * 6, [1] * 8 + [0] * 2])
    pos = jnp.array([list(range(4)) + list(range(6)), list(range(8)) + [0, 0]])
    mask = segment_causal_mask(seg, seg, pos, pos)
    ours = jax.jit(lambda q: attention(q, k, v, mask))
    ref = jax.jit(lambda q: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"))
    np.testing.assert_allclose(ours(q), ref(q), atol=1e-5)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(ours(q) ** 2)))(q)
    grad_ref = jax.jit(jax.grad(lambda q: jnp.sum(ref(q) ** 2)))(q)
    np.testing.assert_allclose(grad, grad_ref, atol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "t"), [(4, 4, 10), (4, 2, 11), (6, 1, 2)])
def test_causal_attention_equals_jax_reference_with_its_gradients(heads, kv_heads, t):
    # The training path: the row-causal mask, half the score blocks skipped, the backward
    # pass written by hand. Packed documents and trailing padding; every input's gradient.
    from stagelm.model.decoder import attention, row_causal_mask

    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (2, t, heads, 8))
    k = jax.random.normal(keys[1], (2, t, kv_heads, 8))
    v = jax.random.normal(keys[2], (2, t, kv_heads, 8))
    cotangent = jax.random.normal(keys[3], (2, t, heads, 8))
    cut = t // 2
    seg = jnp.array([[1] * cut + [2] * (t - cut), [1] * (t - 1) + [0]])
    pos = jnp.array([list(range(cut)) + list(range(t - cut)), list(range(t - 1)) + [0]])
    mask = row_causal_mask(seg, pos)

    def loss(fn):
        return jax.jit(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent))

    ours = loss(lambda q, k, v: attention(q, k, v, mask, causal=True))
    ref = loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"))
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-4)
    grads = [jax.jit(jax.grad(fn, (0, 1, 2)))(q, k, v) for fn in (ours, ref)]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_projections_are_the_ones_config_names():
    # One list names them (LoRA targets are validated against it); the model builds exactly those.
    model = Decoder(CFG, nnx.Rngs(0))
    names = [p.target for _, p in nnx.iter_modules(model.blocks[0]) if isinstance(p, Projection)]
    assert sorted(names) == sorted(PROJECTIONS) and len(names) == len(PROJECTIONS)
    paths = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model.blocks[0]))}
    assert {f"{part}/{name}/w" for part, name in zip(["attn"] * 3 + ["mlp"] * 2, PROJECTIONS, strict=True)} <= paths
