"""The memory arithmetic the stages refuse sizes by agrees with what the model really holds."""

import jax
import pytest
from flax import nnx

from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.model.decoder import Decoder, DecoderConfig, count_params
from stagelm.model.footprint import kv_cache_bytes, param_count
from stagelm.model.kvcache import init_cache


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


def compiled_bytes(compiled) -> int:
    """What XLA says a compiled program allocates beside its arguments (as the train loop reads it)."""
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


@pytest.mark.parametrize(("rows", "width", "new"), [(8, 16, 40), (50, 16, 2000), (64, 32, 40), (4, 256, 512)])
def test_generation_estimate_covers_the_compiled_decode_loop(rows, width, new):
    """The figure eval, GRPO and the benchmark refuse sizes by is never below what XLA allocates
    for the decode loop, and not so far above it that a size that fits is refused."""
    from tokenizers import Tokenizer, models

    from stagelm.infer.generate import Generator, Sampling
    from stagelm.model.footprint import generation_bytes

    cfg = DecoderConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, "t0"))
    gen = Generator(Decoder(cfg, nnx.Rngs(0)), tok, width + new)
    ids = jax.ShapeDtypeStruct((rows, width), jax.numpy.int32)
    stop = jax.ShapeDtypeStruct((512,), bool)
    lowered = gen._loop.lower(gen.params, ids, ids, ids, stop, jax.random.key(0), Sampling(1.0).arrays(), max_new=new)
    actual, estimate = compiled_bytes(lowered.compile()), generation_bytes(cfg, rows, width, new)
    assert actual <= estimate <= 3 * actual, (actual, estimate)


@pytest.mark.parametrize(
    ("rows", "seq_len", "remat"),
    [(4, 64, "none"), (16, 256, "none"), (2, 1024, "none"), (16, 256, "dots"), (16, 256, "block")],
)
def test_train_step_estimate_covers_the_compiled_step(rows, seq_len, remat):
    """train_step_bytes (stagelm check's estimate, by remat policy) against XLA's figures for the compiled step."""
    from stagelm.measure.microbench import bench_optimizer, random_rows
    from stagelm.model.footprint import train_step_bytes
    from stagelm.train.step import init_state, make_optimizer, make_train_step

    cfg = DecoderConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, remat=remat)
    graphdef, params, frozen = nnx.split(Decoder(cfg, nnx.Rngs(0)), nnx.Param, ...)
    tx = make_optimizer(bench_optimizer(3), params)
    step = make_train_step(graphdef, tx)
    batch = {k: jax.numpy.asarray(v[None]) for k, v in random_rows(512, rows, seq_len).items()}
    actual = compiled_bytes(step.lower(init_state(params, tx, jax.random.key(0)), frozen, batch).compile())
    estimate = train_step_bytes(cfg, rows, seq_len)
    assert actual <= estimate <= 3 * actual, (actual, estimate)
