"""The KV cache in both layouts: cached decoding ≡ the full forward pass, on the CPU as on a TPU."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.kvcache import default_layout, init_cache, slot_axis

CFG = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, init_std=0.2)


def test_each_backend_gets_its_layout_and_the_slots_axis_follows_it():
    assert (default_layout("tpu"), default_layout("cpu"), default_layout("gpu")) == ("slots", "heads", "heads")
    heads, slots = init_cache(CFG, 3, 10, "heads"), init_cache(CFG, 3, 10, "slots")
    assert heads.layers[0].k.shape == (3, 2, 10, 8) and slot_axis(heads.layers[0].k) == 2
    assert slots.layers[0].v.shape == (3, 10, 16) and slot_axis(slots.layers[0].v) == 1
    assert slot_axis(slots.segment_ids) == 1


@pytest.mark.parametrize("layout", ["heads", "slots"])
def test_prefill_then_cached_steps_equal_the_full_forward_pass(layout):
    """Two rows, the second left-padded by five slots: the prompt's last logits and each step's
    logits after it are those of the whole row run at once."""
    model = Decoder(CFG, nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (2, 16)), jnp.int32)
    seg = jnp.ones((2, 16), jnp.int32).at[1, :5].set(0)
    pos = jnp.stack([jnp.arange(16), jnp.maximum(jnp.arange(16) - 5, 0)]).astype(jnp.int32)
    full = model(tokens, seg, pos)
    logits, cache = model.prefill(tokens[:, :12], seg[:, :12], pos[:, :12], init_cache(CFG, 2, 16, layout))
    np.testing.assert_allclose(logits[:, 0], full[:, 11], atol=2e-5, rtol=1e-5)
    for i in range(12, 16):
        logits, cache = model.cached(tokens[:, i : i + 1], seg[:, i : i + 1], pos[:, i : i + 1], cache, jnp.int32(i))
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=2e-5, rtol=1e-5)
