"""The KV-cache generator: cached ≡ full-prefix, batch ≡ alone, one compile, seeded sampling."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_decoder
from flax import nnx

from stagelm.data.rawdata import read_raw
from stagelm.infer.generate import Generator, Sampling, as_matrices, sample_tokens
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import sha256_file
from stagelm.measure.evaluation import answer_tasks, pass_at_k, pass_k_metrics
from stagelm.model.decoder import Decoder, DecoderConfig


@pytest.fixture(scope="module")
def gen(micro_data):
    return Generator(*micro_decoder(micro_data), capacity=96)


PROMPTS = ["Once upon a time, Mia", "23 plus 5 is", "Tom saw a big red kite near the river and"]


def ids(gen, text):
    return gen.tokenizer.encode(text, add_special_tokens=False).ids


def test_cached_logits_equal_full_prefix_recomputation(gen):
    prompt = ids(gen, PROMPTS[2])
    continuation = [c for c in gen.generate([prompt], 20)[0].tokens] or [7, 8, 9]
    cached = gen.forced_logits(prompt, continuation)
    _, naive = gen.naive_generate([prompt], len(continuation) + 1, continuation=continuation)
    np.testing.assert_allclose(cached, naive, atol=2e-5, rtol=1e-5)


def test_greedy_cached_generation_equals_naive_and_is_deterministic(gen):
    prompts = [ids(gen, p) for p in PROMPTS]
    stop = np.asarray(gen.stop_mask(False, False))
    first = gen.generate(prompts, 24)
    again = gen.generate(prompts, 24)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    naive, _ = gen.naive_generate(prompts, 24)
    for completion, row in zip(first, naive, strict=True):
        ends = np.flatnonzero(stop[row])
        expected = row[: ends[0]] if len(ends) else row
        assert completion.tokens == expected.tolist()


def test_a_batch_gives_the_same_completions_as_each_prompt_alone(gen):
    prompts = [ids(gen, p) for p in PROMPTS]
    together = gen.generate(prompts, 16, batch=8)
    for prompt, completion in zip(prompts, together, strict=True):
        assert gen.generate([prompt], 16)[0].tokens == completion.tokens


def test_one_compile_per_shape(gen):
    prompts = [ids(gen, p) for p in PROMPTS[:2]]
    gen.generate(prompts, 10, batch=4)
    before = gen._loop._cache_size()
    for sampling in (Sampling(), Sampling(0.7, 5, 0.9), Sampling(1.2, 0, 0.5)):
        gen.generate(prompts[::-1], 10, sampling, jax.random.key(1), batch=4)
    assert gen._loop._cache_size() == before  # sampling settings and prompts are traced values
    steps_before = gen._step._cache_size()
    for prompt in prompts:
        list(gen.stream(prompt, 8))
    list(gen.stream(prompts[0], 8, Sampling(0.9), jax.random.key(2)))
    assert gen._step._cache_size() - steps_before <= 1  # one decode-step compile serves every step and call


def test_seeded_sampling_is_reproducible_and_varies_with_the_key(gen):
    prompt = [ids(gen, PROMPTS[0])]
    s = Sampling(temperature=1.0)
    a = gen.generate(prompt, 20, s, jax.random.key(5))[0].tokens
    assert a == gen.generate(prompt, 20, s, jax.random.key(5))[0].tokens
    others = {tuple(gen.generate(prompt, 20, s, jax.random.key(k))[0].tokens) for k in range(6, 12)}
    assert len(others | {tuple(a)}) > 1


def test_stream_yields_what_generate_returns(gen):
    prompt = ids(gen, PROMPTS[1])
    assert list(gen.stream(prompt, 20)) == gen.generate([prompt], 20)[0].tokens


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)

    def draws(temperature, top_k, top_p):
        f = jax.vmap(lambda k: sample_tokens(logits, k, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)))
        return np.asarray(f(keys))[:, 0]

    assert set(draws(0.0, 0, 1.0)) == {0}  # greedy
    assert set(draws(1.0, 2, 1.0)) == {0, 1}  # top-k 2
    assert set(draws(1.0, 0, 0.7)) == {0, 1}  # nucleus: 0.5 + 0.3 reaches 0.7
    assert set(draws(1.0, 0, 0.01)) == {0}  # at least one token survives
    # No cut (top_k 0, top_p 1) skips the sort: the same draws as the sorted path whose cut keeps all four.
    np.testing.assert_array_equal(draws(1.0, 0, 1.0), draws(1.0, 4, 1.0))
    counts = np.bincount(draws(1.0, 0, 1.0), minlength=4) / len(keys)
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)


def test_model_directory_errors(tmp_path):
    from stagelm.infer.generate import load_generator

    with pytest.raises(StagelmError, match="config.json: missing"):
        load_generator(tmp_path)
    (tmp_path / "config.json").write_text(
        '{"vocab_size": 10, "d_model": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 8, "context_len": 16}'
    )
    with pytest.raises(StagelmError, match="params.safetensors: missing"):
        load_generator(tmp_path)
    (tmp_path / "params.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(StagelmError, match="config.json: no params_sha256, so params.safetensors cannot be verified"):
        load_generator(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    config = json.loads((tmp_path / "config.json").read_text())
    hashes = {
        "params_sha256": sha256_file(tmp_path / "params.safetensors"),
        "tokenizer_sha256": sha256_file(tmp_path / "tokenizer.json"),
    }
    (tmp_path / "config.json").write_text(json.dumps({**config, **hashes}))  # as a writer with a bug would leave it
    with pytest.raises(StagelmError, match="params.safetensors: not a readable safetensors file"):
        load_generator(tmp_path)


def test_bad_inputs(gen, micro_data, tmp_path):
    with pytest.raises(StagelmError, match="top_p"):
        Sampling(top_p=0.0)
    with pytest.raises(StagelmError, match="temperature"):
        Sampling(temperature=-0.1)
    with pytest.raises(StagelmError, match="exceed the cache capacity of 96"):
        gen.generate([list(range(10, 90))], 40)
    other = DecoderConfig(  # fewer rows than the tokenizer has tokens (more are padding, as checkpoints pad)
        vocab_size=gen.tokenizer.get_vocab_size() - 1, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64
    )
    with pytest.raises(StagelmError, match="use the tokenizer.json saved with the model"):
        Generator(Decoder(other, nnx.Rngs(0)), gen.tokenizer, 64)


def test_sampled_eval_answers_are_reproducible_and_greedy_at_a_vanishing_temperature(gen, micro_data):
    """The eval's sampled pass: the same records on a rerun, varied answers at T=1, and the
    greedy answers when the temperature leaves no mass off the argmax."""
    tasks = read_raw(micro_data / "raw", "eval").to_pylist()[:40]
    greedy = answer_tasks(gen, tasks, "chat", 16, 12)
    sampled = answer_tasks(gen, tasks, "chat", 16, 12, temperature=1.0)
    assert sampled == answer_tasks(gen, tasks, "chat", 16, 12, temperature=1.0)
    assert [r["completion"] for r in sampled] != [r["completion"] for r in greedy]
    assert answer_tasks(gen, tasks, "chat", 16, 12, temperature=1e-6) == greedy


def test_pass_at_k_by_hand_and_over_sampled_answers(gen, micro_data):
    """Chen et al.'s estimator on hand cases; over k samples per prompt pass@k is the share of
    prompts with a correct one and pass@1 the share of correct samples."""
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 1, 1) == 0.125
    assert pass_at_k(8, 4, 2) == pytest.approx(1 - 6 / 28)  # C(4, 2) / C(8, 2) pairs hold no correct answer
    # a policy that is right on one answer in four: 1 - 0.75^4 of four-sample tries hold one, on average
    records = [{"family": "a", "correct": i % 4 == 0} for i in range(4 * 100)]
    metrics = pass_k_metrics(records, 4)
    assert metrics["a"]["pass_at_1"] == 0.25 and metrics["a"]["pass_at_4"] == 1.0 and metrics["n"] == 100
    tasks = read_raw(micro_data / "raw", "eval").to_pylist()[:24]
    sampled = answer_tasks(gen, [t for t in tasks for _ in range(4)], "chat", 32, 12, temperature=1.0)
    passes = pass_k_metrics(sampled, 4)
    per_prompt = np.array([r["correct"] for r in sampled]).reshape(24, 4)
    assert passes["pass_at_4"] == pytest.approx(per_prompt.any(axis=1).mean())
    assert passes["pass_at_1"] == pytest.approx(per_prompt.mean())
    assert len({r["completion"] for r in sampled[:4]}) > 1  # four draws, not one answer repeated


def test_the_sampler_draws_what_jax_random_categorical_draws():
    """`first_max` is argmax (ties to the first index), `draw` is categorical: the same tokens
    from the same keys, over rows with ties, -inf (top-k's cut) and large logits."""
    from stagelm.infer.generate import draw, first_max

    logits = jax.random.normal(jax.random.key(0), (64, 300)) * 4
    logits = logits.at[:8, 5].set(100.0).at[:8, 9].set(100.0)  # ties: the first wins
    logits = logits.at[8:16, :290].set(-jnp.inf)
    np.testing.assert_array_equal(first_max(logits), jnp.argmax(logits, -1))
    assert (first_max(logits)[:8] == 5).all()
    for seed in range(5):
        key = jax.random.key(seed)
        np.testing.assert_array_equal(draw(key, logits), jax.random.categorical(key, logits, axis=-1))
        np.testing.assert_array_equal(draw(key, logits / 0.7), jax.random.categorical(key, logits / 0.7, axis=-1))
    assert int(first_max(jnp.full((1, 7), jnp.nan))[0]) == 6  # never an id past the vocabulary


def test_the_slot_major_cache_gives_the_same_tokens(gen, monkeypatch):
    """A TPU's cache layout (`kvcache`), run here: the same greedy tokens batched, alone and streamed."""
    from stagelm.model import kvcache

    prompts = [ids(gen, p) for p in PROMPTS]
    heads = [c.tokens for c in gen.generate(prompts, 16, batch=4)]
    monkeypatch.setattr(kvcache, "default_layout", lambda backend=None: "slots")
    slots = Generator(gen.model, gen.tokenizer, gen.capacity)
    assert [c.tokens for c in slots.generate(prompts, 16, batch=4)] == heads
    assert slots.generate([prompts[2]], 16)[0].tokens == heads[2]
    assert list(slots.stream(prompts[0], 8)) == heads[0][:8]


def test_the_decode_kernel_gives_the_same_tokens(gen):
    """A TPU's decode kernel (`model.decode_attention`, reading only the filled slots), run here
    interpreted under `model.attention: splash`: the reference's greedy tokens, batched with rows of
    different lengths, alone and streamed."""
    import dataclasses

    prompts = [ids(gen, p) for p in PROMPTS]
    heads = [c.tokens for c in gen.generate(prompts, 16, batch=4)]
    cfg = dataclasses.replace(gen.model.cfg, attention="splash")
    kernel = Generator(nnx.merge(nnx.graphdef(Decoder(cfg, nnx.Rngs(0))), gen.params), gen.tokenizer, gen.capacity)
    assert [c.tokens for c in kernel.generate(prompts, 16, batch=4)] == heads
    assert kernel.generate([prompts[2]], 16)[0].tokens == heads[2]
    assert list(kernel.stream(prompts[0], 8)) == heads[0][:8]


def test_the_decode_loop_carries_each_projection_as_its_matrix(gen):
    """`as_matrices`: each projection's weight as the (fan-in, fan-out) matrix its matmul reads, and back."""
    matrices, stored = as_matrices(gen.graphdef, gen.params)
    block, cfg = nnx.merge(gen.graphdef, matrices).blocks[0], gen.model.cfg
    width = cfg.n_heads * cfg.head_dim
    assert block.attn.q.w.shape == (cfg.d_model, width) and block.attn.o.w.shape == (width, cfg.d_model)
    assert block.attn.kv.w.shape == (cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim)
    assert block.mlp.gate_up.w.shape == (cfg.d_model, 2 * cfg.d_ff)
    same = jax.tree.map(lambda a, b: a.shape == b.shape and bool((a == b).all()), stored(matrices), gen.params)
    assert all(jax.tree.leaves(same))
