"""The memory arithmetic the stages refuse sizes by agrees with what the model really holds."""

import jax
import pytest
from flax import nnx

from stagelm.errors import StagelmError
from stagelm.memory import kv_cache_bytes, param_count, require_memory
from stagelm.model import Decoder, DecoderConfig, count_params, init_cache


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (2, 1)])
def test_param_count_is_the_models_own_count(tie, heads, kv_heads):
    shape = {"d_model": 32, "n_layers": 3, "n_heads": heads, "n_kv_heads": kv_heads, "d_ff": 48}
    model = Decoder(DecoderConfig(vocab_size=300, tie_embeddings=tie, **shape), nnx.Rngs(0))
    assert param_count(300, **shape, tie_embeddings=tie) == count_params(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_cache_bytes_are_the_caches_own_bytes(dtype):
    cfg = DecoderConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, dtype=dtype)
    cache = init_cache(cfg, 5, 40)
    assert kv_cache_bytes(cfg, 5, 40) == sum(x.nbytes for x in jax.tree.leaves(cache))


def test_a_need_beyond_what_is_available_names_the_key_and_both_figures():
    require_memory(1 << 20, "eval.max_new_tokens", "a cache", have=4 << 30)  # fits: nothing said
    with pytest.raises(StagelmError, match=r"^eval\.max_new_tokens: a cache needs 3\.0 GiB, but 2\.0 GiB is available"):
        require_memory(3 << 30, "eval.max_new_tokens", "a cache", have=2 << 30)
