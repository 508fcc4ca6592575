"""The splash kernel (Pallas, run here in interpret mode) against the reference attention,
scanned layers against the loop, remat policies against none, and the kernel choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stagelm.infra.errors import StagelmError
from stagelm.infra.mesh import make_mesh
from stagelm.model import attention_kernels
from stagelm.model.attention_kernels import kernel_for, require_kernel, splash_attention
from stagelm.model.decoder import Decoder, DecoderConfig, attention, halves, row_causal_mask

T = 256  # two of splash's 128-token blocks in interpret mode


def packed_rows():
    """Two rows: three documents and padding (segment 0), and one whole document."""
    seg = np.array([[1] * 90 + [2] * 100 + [3] * 40 + [0] * 26, [1] * T])
    pos = np.array([np.concatenate([np.arange(90), np.arange(100), np.arange(40), np.arange(26)]), np.arange(T)])
    return jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tuning"),
    [
        (4, 4, 32, {}),  # the defaults for narrow heads: the fused backward, k sequence-minor
        (4, 2, 32, {}),
        (6, 1, 32, {}),
        (2, 1, 128, {}),  # for heads of 128 and wider: the fused backward, k head-minor
        (4, 2, 32, {"fused_bwd": 0, "k_layout": "HEAD_DIM_MINOR"}),  # the two-pass backward
    ],
)
def test_splash_equals_the_reference_with_its_gradients(heads, kv_heads, head_dim, tuning):
    seg, pos = packed_rows()
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, T, heads, head_dim))
    k, v = (jax.random.normal(key, (2, T, kv_heads, head_dim)) for key in keys[1:3])
    weight = jax.random.normal(keys[3], q.shape)
    mask = row_causal_mask(seg, pos)

    def reference(q, k, v):
        return jnp.sum(attention(q, k, v, mask, causal=True) * weight)

    def splash(q, k, v):
        return jnp.sum(splash_attention(q, k, v, seg, tuple(tuning.items())) * weight)

    np.testing.assert_allclose(splash(q, k, v), reference(q, k, v), rtol=1e-5)
    want, got = jax.grad(reference, (0, 1, 2))(q, k, v), jax.grad(splash, (0, 1, 2))(q, k, v)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5)


def test_halves_are_the_fused_projections_parts():
    y = jax.random.normal(jax.random.key(0), (2, 5, 2, 3, 4))
    first, second = halves(y)
    np.testing.assert_array_equal(first, y[:, :, 0])
    np.testing.assert_array_equal(second, y[:, :, 1])


CFG = DecoderConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48)


def loss_and_grads(cfg: DecoderConfig, mesh=None):
    model = Decoder(cfg, nnx.Rngs(0))
    seg, pos = packed_rows()
    tokens = jax.random.randint(jax.random.key(1), seg.shape, 0, cfg.vocab_size)

    def loss(m):
        return jnp.mean(m(tokens, seg, pos).astype(jnp.float32) ** 2)

    step = nnx.jit(nnx.value_and_grad(loss))
    if mesh is None:
        return step(model)
    with jax.set_mesh(mesh):
        return step(model)


def assert_same(a, b, atol):
    (la, ga), (lb, gb) = a, b
    np.testing.assert_allclose(lb, la, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(y, x, atol=atol)


@pytest.mark.parametrize(
    "change",
    [
        {"attention": "splash"},
        {"scan_layers": True},
        {"remat": "dots"},
        {"remat": "block", "scan_layers": True},
        {"remat": "dots", "scan_layers": True, "attention": "splash"},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_a_decoder_setting_changes_speed_or_memory_not_the_math(change):
    reference = loss_and_grads(dataclasses.replace(CFG, attention="reference"))
    assert_same(reference, loss_and_grads(dataclasses.replace(CFG, **change)), atol=1e-6)


def test_the_decoder_hands_its_splash_tuning_to_the_kernel(monkeypatch):
    asked = []

    def kernel(*args):
        asked.append(args[-1])
        return built(*args)

    built = attention_kernels.splash_kernel
    monkeypatch.setattr(attention_kernels, "splash_kernel", kernel)
    cfg = dataclasses.replace(CFG, attention="splash", splash_tuning=(("k_layout", "HEAD_DIM_MINOR"), ("fused_bwd", 0)))
    model, (seg, pos) = Decoder(cfg, nnx.Rngs(0)), packed_rows()
    jax.eval_shape(lambda: model(seg, seg, pos))  # traced, not compiled
    assert asked and set(asked) == {(("fused_bwd", 0), ("k_layout", "HEAD_DIM_MINOR"))}


def test_splash_sharded_over_the_batch_equals_one_device():
    cfg = dataclasses.replace(CFG, attention="splash")
    one = loss_and_grads(cfg)
    assert_same(one, loss_and_grads(cfg, make_mesh(2, 1, 1, jax.devices()[:2])), atol=1e-6)


def test_the_kernel_choice(monkeypatch):
    assert kernel_for("auto", 2048, "tpu") == "splash"
    assert kernel_for("auto", 1000, "tpu") == "reference"  # rows splash cannot tile
    assert kernel_for("auto", 2048, "cpu") == "reference"
    assert kernel_for("reference", 2048, "tpu") == "reference"
    require_kernel("auto", 100)
    with pytest.raises(StagelmError, match=r"^model.attention: splash is a TPU kernel and this process runs on cpu;"):
        require_kernel("splash", 256)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(
        StagelmError, match=r"blocks of 128 tokens and these rows have 100; use a multiple of 128 \(pack"
    ):
        require_kernel("splash", 100)  # the row length is pack.seq_len's


def test_a_model_trained_with_device_settings_loads_anywhere_with_its_own_math(tmp_path):
    """config.json records what the model is, not how one device ran it: a splash-and-scan model
    loads with `auto` (the reference kernel on this CPU) and unrolled blocks, and computes the same."""
    from tokenizers import Tokenizer, models

    from stagelm.model.modeldir import load_model, model_config_json, save_model

    trained = Decoder(
        dataclasses.replace(CFG, attention="splash", scan_layers=True, splash_tuning=(("fused_bwd", 0),)), nnx.Rngs(4)
    )
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(CFG.vocab_size)}, "t0"))
    save_model(tmp_path / "model", trained, tokenizer, {"context_len": T})
    assert not {"attention", "splash_tuning", "scan_layers"} & set(model_config_json(tmp_path / "model"))
    loaded = load_model(tmp_path / "model")
    assert (loaded.cfg.attention, loaded.cfg.splash_tuning, loaded.cfg.scan_layers) == ("auto", (), False)
    seg, pos = packed_rows()
    tokens = jax.random.randint(jax.random.key(5), seg.shape, 0, CFG.vocab_size)
    np.testing.assert_allclose(nnx.jit(loaded)(tokens, seg, pos), nnx.jit(trained)(tokens, seg, pos), atol=1e-5)
