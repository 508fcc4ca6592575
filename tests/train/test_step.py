"""The train step: accumulation ≡ big batch, the loss masks, schedules, decay mask, learning."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_params
from flax import nnx

from stagelm.data.loader import PackedRows, batch_iterator
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.pipeline.params import load_section
from stagelm.train.step import decay_mask, init_state, lm_loss, lr_schedule, make_optimizer, make_train_step

CFG = DecoderConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


@nnx.jit
def loss_of(model, batch):
    """lm_loss as the train step runs it: one jitted pass (op by op, each op would compile on its own)."""
    return lm_loss(model, batch, None)


def training(**overrides):
    return dataclasses.replace(load_section(micro_params(), "training"), **overrides)


def setup(tcfg, seed=0):
    model = Decoder(CFG, nnx.Rngs(seed))
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(tcfg, params)
    return graphdef, frozen, tx, init_state(params, tx, jax.random.key(seed))


def batches(micro_data, rows, n, seed=0):
    it = batch_iterator(PackedRows(micro_data / "packed/train"), rows, seed)
    return [next(it) for _ in range(n)]


def test_grad_accumulation_equals_one_big_batch(micro_data):
    tcfg = training()
    (big,) = batches(micro_data, 8, 1)
    g, frozen, tx, state_a = setup(tcfg)
    _, _, _, state_b = setup(tcfg)
    step = make_train_step(g, tx)
    state_a, ma = step(state_a, frozen, {k: v[None] for k, v in big.items()})
    state_b, mb = step(state_b, frozen, {k: v.reshape(4, 2, -1) for k, v in big.items()})
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=1e-5)
    assert float(ma["grad_norm"]) == pytest.approx(float(mb["grad_norm"]), rel=1e-5)
    assert float(ma["tokens"]) == float(mb["tokens"])
    # Adam's first update is ~lr·sign(g): where g ≈ 0, float noise moves a weight by a
    # little; 1e-5 is 0.3% of one step at lr 3e-3.
    for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_loss_ignores_padding_and_document_boundaries():
    model = Decoder(CFG, nnx.Rngs(0))
    tokens = jnp.array([[5, 6, 7, 2, 9, 10, 2, 0, 0]])
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]])
    loss, weight = loss_of(model, {"tokens": tokens, "segment_ids": seg, "positions": pos})
    assert float(weight) == 5  # 5→6, 6→7, 7→eos, 9→10, 10→eos; not eos→9, not into padding
    changed = tokens.at[0, 4].set(11)  # the first token of doc 2 is never a target
    loss2, _ = loss_of(model, {"tokens": changed, "segment_ids": seg, "positions": pos})
    assert float(loss2) != float(loss)  # it is an input though
    pad_changed = tokens.at[0, 8].set(33)
    loss3, _ = loss_of(model, {"tokens": pad_changed, "segment_ids": seg, "positions": pos})
    assert float(loss3) == float(loss)


def test_loss_mask_limits_the_loss_to_marked_targets():
    model = Decoder(CFG, nnx.Rngs(0))
    # <|user|> a b <|end|> <|assistant|> c d <|end|> <|user|> e : the row's last token is only ever a target.
    tokens = jnp.array([[3, 40, 41, 5, 4, 60, 61, 5, 3, 42]])
    mask = jnp.array([[0, 0, 0, 0, 0, 1, 1, 1, 0, 0]])
    batch = {
        "tokens": tokens,
        "segment_ids": jnp.ones((1, 10), int),
        "positions": jnp.arange(10)[None],
        "loss_mask": mask,
    }
    loss, weight = loss_of(model, batch)
    assert float(weight) == 3
    user_target = {**batch, "tokens": tokens.at[0, 9].set(77)}
    assert float(loss_of(model, user_target)[0]) == float(loss)
    trained = {**batch, "loss_mask": mask.at[0, 9].set(1)}
    assert float(loss_of(model, {**trained, "tokens": tokens.at[0, 9].set(77)})[0]) != float(loss_of(model, trained)[0])


@pytest.mark.parametrize("schedule", ["constant", "cosine", "wsd"])
def test_schedules(schedule):
    cfg = training(schedule=schedule, lr=1.0, warmup_steps=10, steps=100, min_lr_ratio=0.1, decay_fraction=0.2)
    s = lr_schedule(cfg)
    lrs = np.array([float(s(i)) for i in range(100)])
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert (np.diff(lrs[:10]) > 0).all()
    if schedule == "constant":
        assert np.allclose(lrs[9:], 1.0)
    elif schedule == "cosine":
        assert (np.diff(lrs[9:]) <= 1e-7).all() and lrs[-1] == pytest.approx(0.1, abs=0.01)
    else:
        assert np.allclose(lrs[9:82], 1.0) and lrs[-1] == pytest.approx(0.1, abs=0.02)


def test_no_weight_decay_on_norms_and_embeddings_unless_asked():
    params = nnx.state(Decoder(CFG, nnx.Rngs(0)), nnx.Param)
    mask = nnx.to_pure_dict(decay_mask(params, decay_embeddings=False))
    assert not mask["embed"] and not mask["final_norm"]
    assert mask["blocks"][0]["attn"]["q"]["w"] and not mask["blocks"][0]["attn_norm"]
    assert nnx.to_pure_dict(decay_mask(params, decay_embeddings=True))["embed"]


def test_loss_falls_on_the_packed_corpus(micro_data):
    tcfg = training(steps=60, warmup_steps=4, lr=1e-2)
    g, frozen, tx, state = setup(tcfg)
    step = make_train_step(g, tx)
    losses = []
    for b in batches(micro_data, 8, 60):
        state, m = step(state, frozen, {k: v[None] for k, v in b.items()})
        losses.append(float(m["loss"]))
    unigram = PackedRows(micro_data / "packed/train").manifest["unigram_entropy_nats"]
    # Below the unigram entropy means the model uses context, not only token frequencies.
    assert np.mean(losses[:3]) > unigram > np.mean(losses[-5:])
    assert int(state.step) == 60


def test_sgd_with_momentum_by_hand():
    """grpo.optimizer: sgd is SGD with momentum beta1 and decoupled weight decay, on the schedule."""
    cfg = load_section(micro_params(grpo={"optimizer": "sgd", "lr": 0.1, "warmup_steps": 0, "beta1": 0.5}), "grpo")
    cfg = dataclasses.replace(cfg, schedule="constant", grad_clip=0.0, weight_decay=0.01)
    params = {"w": jnp.array([[1.0, -2.0]]), "norm": jnp.array([3.0])}  # decay on the matrix only
    tx = make_optimizer(cfg, params)
    state = tx.init(params)
    grads = [
        {"w": jnp.array([[0.5, 0.5]]), "norm": jnp.array([1.0])},
        {"w": jnp.array([[-1.0, 0.0]]), "norm": jnp.array([0.0])},
    ]
    expected, trace = {k: np.asarray(v) for k, v in params.items()}, {k: 0.0 for k in params}
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        for k in expected:
            decayed = np.asarray(g[k]) + (0.01 * expected[k] if k == "w" else 0.0)
            trace[k] = decayed + 0.5 * trace[k]
            expected[k] = expected[k] - 0.1 * trace[k]
    for k in expected:
        np.testing.assert_allclose(params[k], expected[k], rtol=1e-6)
