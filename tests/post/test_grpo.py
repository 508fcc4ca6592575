"""GRPO: advantages and the clipped loss on hand-computed cases, on-policy ≡ policy gradient, the stage."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, built_once, micro_params, run, run_in_process, tree_bytes, write_params
from flax import nnx
from resume import assert_same_outputs, killed_and_whole

from stagelm.data.loader import PackedRows
from stagelm.data.tokenizer import chat_segments, load_tokenizer
from stagelm.infer.generate import Generator, Sampling
from stagelm.infra.files import read_json
from stagelm.infra.mesh import make_mesh
from stagelm.model.decoder import Decoder, DecoderConfig, count_params
from stagelm.model.lora import NORMS
from stagelm.model.modeldir import load_model, read_model_context
from stagelm.pipeline.params import load_section
from stagelm.post.grpo import group_advantages, grpo_loss, token_logprobs
from stagelm.post.rollouts import (
    Group,
    Rollouts,
    graded_length,
    rollout_metrics,
    rollout_sets,
    sample_weights,
    unsure_prompts,
)
from stagelm.tasks import one_line, step_credit
from stagelm.tasks.arithmetic import arithmetic_task, working
from stagelm.train.loop import train
from stagelm.train.run import TrainRun
from stagelm.train.step import init_state, lm_loss, lr_schedule, make_optimizer, make_train_step, next_token_targets

CFG = DecoderConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)


def test_group_advantages_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 0.0, 2.0]])
    adv = group_advantages(rewards)
    std = np.sqrt(0.1875)  # rewards 1,0,0,0: mean 0.25, variance 0.75·0.25
    np.testing.assert_allclose(adv[0], [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rtol=1e-5)
    np.testing.assert_array_equal(adv[1], 0.0)  # a group that agrees teaches nothing
    np.testing.assert_allclose(adv[2], [-1, 1, -1, 1], rtol=1e-5)
    unscaled = group_advantages(rewards, "none")  # Dr. GRPO: the reward less the group's mean, no std
    np.testing.assert_allclose(unscaled, [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0], [-1, 1, -1, 1]], rtol=1e-6)


def test_graded_length_stops_at_the_end_of_the_answer():
    ends = np.zeros(10, bool)
    ends[7] = True  # say token 7 is "."
    assert graded_length([3, 4, 7, 5, 5], stopped=False, ends_answer=ends) == 3
    assert graded_length([3, 4, 5], stopped=True, ends_answer=ends) == 4  # the stop token trains too
    assert graded_length([3, 4, 5], stopped=False, ends_answer=ends) == 3


def group(correct: list[bool], rewards: list[float] | None = None) -> Group:
    """A scored group of `len(correct)` samples (the rows themselves do not matter here)."""
    n = len(correct)
    rewards = [float(c) for c in correct] if rewards is None else rewards
    return Group(0, np.zeros((n, 3), np.int32), rewards, correct, [True] * n, [3] * n, [0.6] * n)


# The policy gradient on every weight with flat prompt weights (not the shipped default's): the tests of
# its update by hand, and those whose micro policy earns only the format reward, which rft ignores
GRPO_OBJECTIVE = {"objective": "grpo", "method": "full", "prompt_weight": "flat"}


def grpo_section(**change):
    """The grpo section, GRPO's own objective on every weight unless `change` says otherwise."""
    return load_section(micro_params(grpo=GRPO_OBJECTIVE | change), "grpo")


def test_sample_weights_of_each_objective_by_hand():
    groups = [group([True, False, False, False]), group([True, True, False, True]), group([False] * 4)]
    adv = group_advantages(np.array([g.rewards for g in groups], np.float32))
    np.testing.assert_allclose(sample_weights(groups, grpo_section()), adv, rtol=1e-6)  # today's GRPO: 1 and 1
    positive_only = sample_weights(groups, grpo_section(positive_weight=1.0, negative_weight=0.0))
    np.testing.assert_allclose(positive_only, np.maximum(adv, 0), rtol=1e-6)
    tilted = sample_weights(groups, grpo_section(positive_weight=2.0, negative_weight=0.5))
    np.testing.assert_allclose(tilted, np.where(adv > 0, 2 * adv, 0.5 * adv), rtol=1e-6)
    every = sample_weights(groups, grpo_section(objective="rft"))
    np.testing.assert_array_equal(every, [[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]])
    one = sample_weights(groups, grpo_section(objective="rft", rft_keep="one"))
    np.testing.assert_array_equal(one, [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the first right one


def test_unsure_prompt_weights_by_hand():
    groups = [group([True, False, False, False]), group([True, True, False, True]), group([True] * 4)]
    # rft: correct samples times each group's wrong share (3/4, 1/4, 0), rescaled so the nonzero weights average 1
    unsure = sample_weights(groups, grpo_section(objective="rft", prompt_weight="unsure"))
    scale = 4 / (0.75 + 3 * 0.25)
    np.testing.assert_allclose(unsure, [[0.75 * scale, 0, 0, 0], [0.25 * scale] * 2 + [0, 0.25 * scale], [0] * 4])
    assert [g.teaches(grpo_section(objective="rft", prompt_weight="unsure")) for g in groups] == [True, True, False]
    assert groups[2].teaches(grpo_section(objective="rft", prompt_weight="flat"))  # flat rft trains on an all-right one
    adv = sample_weights(groups, grpo_section())  # grpo: the advantages times the same shares, the same rescaling
    tilted = adv * np.array([[0.75], [0.25], [0]])
    tilted *= np.abs(adv[adv != 0]).mean() / np.abs(tilted[tilted != 0]).mean()
    np.testing.assert_allclose(sample_weights(groups, grpo_section(prompt_weight="unsure")), tilted, rtol=1e-6)


def test_rollout_metrics_split_the_groups_and_weigh_entropy_by_token():
    groups = [group([True] * 4), group([True, False, True, False]), group([False] * 4), group([False] * 4)]
    groups[0].entropy, groups[0].lengths = [0.0] * 4, [1] * 4  # 4 tokens at entropy 0
    m = rollout_metrics(groups)  # the other 12 samples: 3 tokens each, 0.6 nats summed (0.2 a token)
    assert m["rollout/all_right_groups"] == 0.25 and m["rollout/all_wrong_groups"] == 0.5
    assert m["rollout/mixed_groups"] == 0.25 and m["rollout/accuracy"] == 6 / 16
    assert m["rollout/entropy"] == pytest.approx(12 * 0.6 / (4 + 36))


def test_step_credit_pays_right_columns_and_full_credit_only_for_the_answer():
    spec, prompt = {"answer": 81}, "What is 23 plus 58?"  # 3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 81.
    assert step_credit("arithmetic", spec, prompt, "3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 81.") == 1.0
    assert step_credit("arithmetic", spec, prompt, "3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 82.") == 0.5
    assert step_credit("arithmetic", spec, prompt, "3 plus 8 is 11, 2 plus 5 is 7, so 71.") == pytest.approx(0.5 / 3)
    assert step_credit("arithmetic", spec, prompt, "3 plus 8 is 12, 2 plus 1 is 3, so 32.") == 0.0
    assert step_credit("arithmetic", spec, prompt, "81.") == 1.0  # a bare right answer is right
    assert step_credit("arithmetic", {"answer": 33}, "What is 71 minus 38?", "so 34.") == 0.0
    borrow = "11 minus 8 is 3, 7 minus 1 minus 3 is 3, so 34."  # both columns and the borrow right
    assert step_credit("arithmetic", {"answer": 33}, "What is 71 minus 38?", borrow) == 0.5
    three = "3 plus 1 is 4, 4 plus 8 is 12, 2 plus 5 is 7, so 724."  # 5 steps: 3 results, 2 carries; 3 right
    assert step_credit("three_digit", {"answer": 824}, "What is 243 plus 581?", three) == pytest.approx(0.5 * 3 / 5)


def test_rft_loss_is_the_next_token_loss_of_the_kept_samples():
    model = Decoder(CFG, nnx.Rngs(0))
    batch, _ = rollout_batch(model, old_shift=float(np.log(1.5)))  # off-policy ratios: rft ignores them
    batch["on_policy"] = jnp.zeros_like(batch["advantages"])
    batch["advantages"] = jnp.array([[1.0] * 6, [0.0] * 6])
    batch["completion_mask"] = batch["completion_mask"].at[1].set(0)  # row 1 is wrong: it does not train
    loss, weight, _ = grpo_loss(0.2, 0.0, objective="rft")(model, batch, None)
    rows = {k: batch[k] for k in ("tokens", "segment_ids", "positions")} | {"loss_mask": batch["completion_mask"]}
    ce, count = lm_loss(model, rows, None)
    assert float(weight) == float(count) == 3
    np.testing.assert_allclose(float(loss), float(ce), rtol=1e-6)


def test_grad_accum_gives_the_update_of_one_batch():
    """A rollout's rows in two micro-batches take the step the whole rollout takes at once."""
    model = Decoder(CFG, nnx.Rngs(0))
    batch, _ = rollout_batch(model)
    batch = {k: jnp.concatenate([v, v[::-1]]) for k, v in batch.items()}  # 4 rows
    batch["on_policy"] = jnp.ones_like(batch["advantages"])
    graphdef, params = nnx.split(model)
    # SGD (grpo.optimizer: sgd) at lr 1: the step is the gradient itself, not Adam's sign-like ratio
    section = grpo_section(optimizer="sgd", lr=1.0, warmup_steps=0, grad_clip=0.0, weight_decay=0.0)
    tx = make_optimizer(section, params)
    step = make_train_step(graphdef, tx, grpo_loss(0.2, 0.1))
    out = {}
    for accum in (1, 2):
        micro = {k: v.reshape(accum, -1, v.shape[-1]) for k, v in batch.items()}
        out[accum] = step(init_state(jax.tree.map(jnp.copy, params), tx, jax.random.key(0)), nnx.State({}), micro)
    np.testing.assert_allclose(float(out[1][1]["loss"]), float(out[2][1]["loss"]), rtol=1e-6)
    moved = 0.0
    for a, b, before in zip(*(jax.tree.leaves(x) for x in (out[1][0].params, out[2][0].params, params)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
        moved = max(moved, float(jnp.max(jnp.abs(a - before))))
    assert moved > 1e-3  # the step did move the weights


def test_norms_method_trains_the_rmsnorm_gains_alone():
    """grpo.method norms: the step moves each block's two gains and the final one, nothing else."""
    model = Decoder(CFG, nnx.Rngs(0))
    batch, _ = rollout_batch(model)
    batch["on_policy"] = jnp.ones_like(batch["advantages"])
    graphdef, gains, frozen = nnx.split(model, NORMS, ...)
    assert len(jax.tree.leaves(gains)) == 2 * CFG.n_layers + 1
    assert all(x.shape == (CFG.d_model,) for x in jax.tree.leaves(gains))
    section = grpo_section(optimizer="sgd", lr=1.0, warmup_steps=0, grad_clip=0.0, weight_decay=0.0)
    tx = make_optimizer(section, gains)
    step = make_train_step(graphdef, tx, grpo_loss(0.2, 0.1))
    micro = {k: v[None] for k, v in batch.items()}
    state, _ = step(init_state(jax.tree.map(jnp.copy, gains), tx, jax.random.key(0)), frozen, micro)
    pairs = zip(jax.tree.leaves(state.params), jax.tree.leaves(gains), strict=True)
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in pairs]
    assert min(moved) > 0.0  # every gain took the step; the frozen rest is not in the step's state at all


def test_rollout_entropy_is_the_policys_own(micro_data, policy):
    """The sampler's per-token entropy equals the entropy of the policy's full forward pass over
    the sampled rows, at the sampling temperature."""
    model = load_model(policy)
    gen = Generator(model, load_tokenizer(policy / "tokenizer.json"), read_model_context(policy))
    cfg = grpo_section(prompts_per_step=4, group_size=2, anchor_coef=0.0)
    rollouts = Rollouts(cfg, gen, nnx.graphdef(model), rollout_sets(micro_data / "raw", cfg)[0], seed=0)
    prompts = [rollouts.prompts[i] for i in range(4) for _ in range(2)]
    tokens, seg, pos = gen.layout(prompts, cfg.max_new_tokens)
    stop = gen.stop_mask(chat=True, stop_at_newline=True)
    for temperature in (1.0, 0.5):
        sampled, stats = gen.decode(
            gen.params, tokens, seg, pos, stop, jax.random.key(1), Sampling(temperature), cfg.max_new_tokens, True
        )
        full = jnp.concatenate([tokens, sampled], 1)
        fseg = jnp.concatenate([seg, jnp.ones_like(sampled)], 1)
        fpos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(cfg.max_new_tokens)[None]], 1)
        logits = model(full, fseg, fpos)[:, tokens.shape[1] - 1 : -1] / temperature
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        entropy = -jnp.sum(jnp.exp(logp) * logp, -1)
        live = np.asarray(stats["entropy"]) != 0  # steps after a row's stop token are zeroed
        assert live[:, 0].all()
        np.testing.assert_allclose(np.asarray(stats["entropy"])[live], np.asarray(entropy)[live], atol=1e-4)


def test_rft_rollout_trains_the_correct_samples_only(micro_data, policy):
    model = load_model(policy)
    gen = Generator(model, load_tokenizer(policy / "tokenizer.json"), read_model_context(policy))
    cfg = grpo_section(objective="rft", prompts_per_step=2, group_size=4, anchor_coef=0.0, kl_coef=0.0)
    rollouts = Rollouts(cfg, gen, nnx.graphdef(model), rollout_sets(micro_data / "raw", cfg)[0], seed=0)
    groups = rollouts.sample_groups(gen.params, np.arange(2), jax.random.key(0))
    stop = gen.stop_mask(chat=True, stop_at_newline=one_line(cfg.families))
    for g in groups:  # tokens generated, through each row's stop: at least the ones that train
        done = [gen.completion(row, stop) for row in g.rows]
        assert g.sampled == [len(c.tokens) + (c.finish == "stop") for c in done]
        assert all(n <= s for n, s in zip(g.lengths, g.sampled, strict=True))
    for g, correct in zip(groups, ([True, False, False, True], [False] * 4), strict=True):
        g.correct = correct  # say so: the micro policy answers no sum right
    batch = rollouts.layout(gen.params, groups)
    trained = batch["completion_mask"].sum(1)
    lengths = [n for g in groups for n in g.lengths]
    np.testing.assert_array_equal(trained, [lengths[0], 0, 0, lengths[3], 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["advantages"][:, 0], [1, 0, 0, 1, 0, 0, 0, 0])
    # No KL penalty and no anchor: no reference is kept, and no rollout is scored by one.
    assert rollouts.ref is None and "ref_logp" not in batch
    cfg = grpo_section(objective="rft", prompts_per_step=2, group_size=4, anchor_coef=0.0, kl_coef=0.05)
    penalised = Rollouts(cfg, gen, nnx.graphdef(model), rollouts.tasks, seed=0)
    ref_batch = penalised.layout(gen.params, groups)
    np.testing.assert_array_equal(ref_batch["tokens"], batch["tokens"])
    assert ref_batch["ref_logp"].shape == batch["tokens"].shape


def rollout_batch(model, old_shift: float = 0.0):
    """Two rows of 6 tokens: a 3-token prompt and a 3-token completion (the last row's last token masked)."""
    tokens = jnp.array([[1, 5, 6, 7, 8, 9], [1, 5, 6, 10, 11, 12]])
    seg, pos = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(6), tokens.shape)
    mask = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0]])
    batch = {"tokens": tokens, "segment_ids": seg, "positions": pos, "completion_mask": mask}
    inputs, targets, _ = next_token_targets(batch)
    logp = token_logprobs(model(inputs["tokens"], inputs["segment_ids"], inputs["positions"]), targets)
    logp = jnp.pad(logp, ((0, 0), (1, 0)))
    adv = jnp.array([[1.5] * 6, [-0.5] * 6])
    batch.update(advantages=adv, ref_logp=logp - 0.1, old_logp=logp - old_shift)
    return batch, logp


def test_on_policy_update_is_exactly_the_policy_gradient():
    model = Decoder(CFG, nnx.Rngs(0))
    batch, logp = rollout_batch(model)
    batch["on_policy"] = jnp.ones_like(batch["advantages"])
    del batch["ref_logp"]  # with no KL penalty the loss reads no reference (the rollouts carry none)
    graphdef, params = nnx.split(model)
    mask, adv = batch["completion_mask"][:, 1:], batch["advantages"][:, 1:]

    def grpo(p):
        loss, weight, aux = grpo_loss(0.2, 0.0)(nnx.merge(graphdef, p), batch, None)
        return loss / weight, aux

    def reinforce(p):  # the plain policy-gradient surrogate: -mean over completion tokens of A·log π
        inputs, targets, _ = next_token_targets(batch)
        m = nnx.merge(graphdef, p)
        lp = token_logprobs(m(inputs["tokens"], inputs["segment_ids"], inputs["positions"]), targets)
        return -jnp.sum(adv * lp * mask) / jnp.sum(mask)

    (value, aux), grads = jax.jit(jax.value_and_grad(grpo, has_aux=True))(params)
    assert "kl" not in aux  # nothing measured against a reference that was not scored
    assert float(aux["ratio"]) == float(jnp.sum(mask))  # every ratio is exactly 1
    assert float(aux["clip_fraction"]) == 0.0
    np.testing.assert_allclose(float(value), float(-jnp.sum(adv * mask) / jnp.sum(mask)), rtol=1e-6)
    expected = jax.jit(jax.grad(reinforce))(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, atol=1e-7, rtol=1e-5)


def test_clipping_and_kl_by_hand():
    model = Decoder(CFG, nnx.Rngs(0))
    shift = float(np.log(1.5))  # old log-probs lower by log 1.5: every ratio is 1.5
    batch, logp = rollout_batch(model, old_shift=shift)
    batch["on_policy"] = jnp.zeros_like(batch["advantages"])
    loss, weight, aux = grpo_loss(0.2, 0.5)(model, batch, None)
    # row 0 (A = 1.5 > 0): clipped to 1.2·A; row 1 (A = -0.5 < 0): the pessimistic min keeps 1.5·A
    kl = np.exp(-0.1) + 0.1 - 1  # ref = logp - 0.1: k3 = exp(-0.1) - (-0.1) - 1 per token
    expected = 3 * (-1.2 * 1.5 + 0.5 * kl) + 2 * (-1.5 * -0.5 + 0.5 * kl)
    assert float(weight) == 5
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(aux["clip_fraction"]), 5, rtol=1e-6)
    np.testing.assert_allclose(float(aux["kl"]), 5 * kl, rtol=1e-4)
    # DAPO's higher upper clip: row 0's ratio is held at 1.28, not 1.2; row 1 is as before
    loss, _, aux = grpo_loss(0.2, 0.5, clip_eps_high=0.28)(model, batch, None)
    expected = 3 * (-1.28 * 1.5 + 0.5 * kl) + 2 * (-1.5 * -0.5 + 0.5 * kl)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(aux["clip_fraction"]), 5, rtol=1e-6)


def test_entropy_term_by_hand():
    """entropy_coef · the next-token distribution's entropy, summed over the completion tokens, leaves the loss."""
    model = Decoder(CFG, nnx.Rngs(0))
    batch, _ = rollout_batch(model)
    batch["on_policy"] = jnp.ones_like(batch["advantages"])
    inputs, _, _ = next_token_targets(batch)
    q = jax.nn.softmax(model(inputs["tokens"], inputs["segment_ids"], inputs["positions"]))
    by_hand = -jnp.sum(q * jnp.log(q), axis=-1)  # (rows, positions)
    plain, weight, _ = grpo_loss(0.2, 0.0)(model, batch, None)
    loss, same, _ = grpo_loss(0.2, 0.0, entropy_coef=0.3)(model, batch, None)
    summed = float(jnp.sum(by_hand * batch["completion_mask"][:, 1:]))
    assert float(same) == float(weight) and summed > 0
    np.testing.assert_allclose(float(loss), float(plain) - 0.3 * summed, rtol=1e-5)


def test_anchor_term_by_hand():
    """anchor_coef · mean k3 over the anchor rows' answer tokens, scaled to the rollout's token count."""
    model = Decoder(CFG, nnx.Rngs(0))
    batch, _ = rollout_batch(model)
    batch["on_policy"] = jnp.ones_like(batch["advantages"])
    anchor = {
        "tokens": jnp.array([[1, 3, 4, 5, 0], [1, 6, 7, 8, 9]]),
        "segment_ids": jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        "positions": jnp.array([[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]),
        "loss_mask": jnp.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]),
    }
    inputs, targets, weights = next_token_targets(anchor)
    logp = token_logprobs(model(inputs["tokens"], inputs["segment_ids"], inputs["positions"]), targets)
    assert float(jnp.sum(weights)) == 6  # padding and the prompt tokens do not count
    plain, weight, _ = grpo_loss(0.2, 0.0)(model, batch, None)
    at_reference = {f"anchor_{k}": v for k, v in anchor.items()} | {"anchor_ref_logp": jnp.pad(logp, ((0, 0), (1, 0)))}
    same, _, aux = grpo_loss(0.2, 0.0, anchor_coef=3.0)(model, batch | at_reference, None)
    np.testing.assert_allclose(float(same), float(plain), atol=1e-6)  # no penalty at the reference
    assert abs(float(aux["anchor_kl"])) < 1e-6
    moved = at_reference | {"anchor_ref_logp": at_reference["anchor_ref_logp"] - 0.1}
    loss, _, aux = grpo_loss(0.2, 0.0, anchor_coef=3.0)(model, batch | moved, None)
    k3 = np.exp(-0.1) + 0.1 - 1
    np.testing.assert_allclose(float(loss), float(plain) + 3.0 * k3 * float(weight), rtol=1e-5)
    np.testing.assert_allclose(float(aux["anchor_kl"]) / float(weight), k3, rtol=1e-4)


# --- the stage, as a process -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(micro_data, tmp_path_factory):
    """A micro model trained by the pretrain stage then the SFT stage (full fine-tuning), once a run."""
    return built_once(tmp_path_factory, "policy", lambda work: train_policy(micro_data, work))


def train_policy(micro_data, work):
    write_params(work / "params.yaml", micro_params(training={"steps": 40}, sft={"method": "full", "steps": 40}))
    py = sys.executable
    run(
        [py, str(ROOT / "stages/pretrain.py"), "--params", "params.yaml"]
        + ["--train", str(micro_data / "packed/train"), "--val", str(micro_data / "packed/val")]
        + ["--tokenizer", str(micro_data / "tokenizer/tokenizer.json"), "--out", "pre", "--checkpoints", "ck"],
        work,
    )
    run(
        [py, str(ROOT / "stages/sft.py"), "--params", "params.yaml", "--model", "pre/model"]
        + ["--train", str(micro_data / "packed/sft"), "--corpus", str(micro_data / "packed/train")]
        + ["--val", str(micro_data / "packed/val"), "--out", "sft", "--checkpoints", "ck_sft"],
        work,
    )
    return work / "sft/model"


def grpo_command(micro_data, model, work):
    return [
        sys.executable,
        str(ROOT / "stages/grpo.py"),
        "--params",
        str(work / "params.yaml"),
        "--model",
        str(model),
        "--raw",
        str(micro_data / "raw"),
        "--val",
        str(micro_data / "packed/val"),
        "--out",
        str(work / "out"),
        "--checkpoints",
        str(work / "ckpt"),
    ]


def rewards_of(work, metric: str = "reward"):
    rows = (work / f"out/plots/metrics/rollout/{metric}.tsv").read_text().strip().splitlines()[1:]
    return [float(r.split("\t")[1]) for r in rows]


@pytest.mark.slow
def test_grpo_mean_reward_rises(micro_data, policy, tmp_path):
    """A reward the micro policy can earn more of: well-formed answers (format reward only)."""
    change = {
        "families": ["uses_word"],
        "format_weight": 1.0,
        "steps": 40,
        "eval_every": 40,
        "checkpoint_every": 40,
        "lr": 3e-4,
        "updates_per_rollout": 1,
        "kl_coef": 0.0,
        "objective": "grpo",  # the policy gradient on every weight: rft trains on right answers, not on form
        "method": "full",
    }
    write_params(tmp_path / "params.yaml", micro_params(grpo=change))
    run(grpo_command(micro_data, policy, tmp_path), tmp_path)
    rewards = rewards_of(tmp_path)
    assert len(rewards) == 40
    assert np.mean(rewards[-8:]) > np.mean(rewards[:8]) + 0.1, rewards
    summary = read_json(tmp_path / "out/metrics.json")  # what `dvc exp show` lists beside the loss
    assert summary["reward_first10"] == pytest.approx(np.mean(rewards[:10]), abs=1e-6)
    assert summary["reward_last10"] == pytest.approx(np.mean(rewards[-10:]), abs=1e-6)
    # Both phases' speed: completion tokens sampled, and the rows' tokens trained on, per second
    # (medians over the rollouts); the update's MFU only against a published peak: a CPU has none.
    perf = (tmp_path / "out/plots/metrics/perf/rollout_tokens_per_sec.tsv").read_text().strip().splitlines()[1:]
    speeds = [float(r.split("\t")[1]) for r in perf]
    assert (
        summary["rollout_tokens_per_sec"] == pytest.approx(np.median(speeds)) and summary["rollout_tokens_per_sec"] > 0
    )
    assert summary["update_tokens_per_sec"] > 0 and summary["update_mfu"] is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_grpo_stage_resumes_after_sigkill_bitwise(micro_data, policy, tmp_path, method):
    change = {"steps": 12, "eval_every": 12, "checkpoint_every": 2, "updates_per_rollout": 2, "kl_coef": 0.05}
    change |= {"dynamic_sampling": False}  # the plain rollout (one batch of prompts each)
    if method == "lora":  # adapters only, with the anchor term: its rows are drawn per (seed, rollout, update),
        # and dynamic sampling: the prompts a rollout drew beyond its own batch move the stream on
        change |= {"method": "lora", "lr": 1e-3, "dynamic_sampling": True, "max_draws": 2, "anchor_coef": 1.0}
        change |= {"objective": "grpo"}  # the micro policy answers no sum right: rft would train on nothing
    else:  # every weight, on a reward the micro policy earns (rft would train on nothing: it answers no sum)
        change |= {"objective": "grpo", "method": "full", "families": ["uses_word"], "format_weight": 1.0}
        change |= {"revisit": 0.5}  # the unsure prompts a rollout found are in the checkpoint, for the next one
    command = lambda work: grpo_command(micro_data, policy, work)  # noqa: E731
    killed, whole, _ = killed_and_whole(tmp_path, micro_params(grpo=change), command)
    assert_same_outputs(killed, whole, "model")
    a = load_model(killed / "out/model")
    assert rewards_of(killed) == rewards_of(whole)
    drawn = [rewards_of(w, "prompts_drawn") for w in (killed, whole)]
    assert drawn[0] == drawn[1] and (max(drawn[1]) > 8) == (method == "lora"), drawn
    revisited = [rewards_of(w, "prompts_revisited") for w in (killed, whole)]
    assert revisited[0] == revisited[1] and (max(revisited[1]) > 0) == (method == "full"), revisited
    provenance = read_json(whole / "out/provenance.json")
    assert provenance["stage"] == "grpo"
    before = load_model(policy)
    # lora: the saved model is merged, an ordinary decoder moved off the SFT weights; full: every weight trains
    assert a.cfg.lora_rank == 0 and (provenance["trainable_params"] < count_params(a)) == (method == "lora")
    pairs = zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(before)), strict=True)
    assert any(not np.array_equal(x, y) for x, y in pairs)


@pytest.mark.slow
def test_grpo_seed_draws_as_the_top_level_seed_does(micro_data, policy, tmp_path):
    """`grpo.seed` S is the stage's own: on the same SFT model the stage under seed 0 with grpo.seed S
    writes the bytes it writes under seed S, and other bytes than under seed 0 alone."""
    change = {"steps": 2, "eval_every": 2, "checkpoint_every": 2, "dynamic_sampling": False, "objective": "grpo"}
    change |= {"method": "full", "families": ["uses_word"], "format_weight": 1.0}  # rewards the micro policy earns
    change |= {"max_new_tokens": 12, "eval_batches": 1}
    for name, seed, own in (("own", 0, 5), ("top", 5, None), ("base", 0, None)):
        work = tmp_path / name
        work.mkdir()
        write_params(work / "params.yaml", micro_params(grpo=change | {"seed": own}, seed=seed))
        run(grpo_command(micro_data, policy, work), work)
    assert_same_outputs(tmp_path / "own", tmp_path / "top", "model")
    assert rewards_of(tmp_path / "own") == rewards_of(tmp_path / "top")
    assert tree_bytes(tmp_path / "own/out/model") != tree_bytes(tmp_path / "base/out/model")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group_size": 1}, "grpo.group_size: expected an int >= 2"),
        ({"temperature": 0.0}, "grpo.temperature: expected a positive float, got 0.0"),
        ({"families": ["poetry"]}, "grpo.families: unknown ['poetry']"),
        ({"checkpoint_every": 3, "updates_per_rollout": 2}, "grpo.checkpoint_every: 3 is not a multiple"),
        ({"max_new_tokens": 500}, "grpo.max_new_tokens: 500 plus the longest rl prompt"),
        (
            {"method": "lora", "lora": {"rank": 999, "alpha": 8.0, "dropout": 0.0, "targets": ["q"]}},
            "grpo.lora.rank: 999",
        ),
        (
            {"families": ["arithmetic", "uses_word", "word_limit"], "anchor_coef": 1.0},
            "grpo.anchor_coef: 1.0 needs 4 (grpo.anchor_rows) SFT conversations outside grpo.families",
        ),
        ({"grad_accum": 3}, "grpo.grad_accum: 3 does not divide grpo.prompts_per_step 8"),
        ({"families": ["uses_word"], "reward": "steps"}, "grpo.reward: steps needs families whose answers have"),
        ({"objective": "dpo"}, "grpo.objective: expected one of 'grpo', 'rft', got 'dpo'"),
        ({"seed": -1}, "grpo.seed: expected an int in [0, 2**32), got -1"),
    ],
)
def test_grpo_bad_params_fail_in_one_line(micro_data, policy, tmp_path, change, message, capsys):
    write_params(tmp_path / "params.yaml", micro_params(grpo=change))
    code, stderr = run_in_process(grpo_command(micro_data, policy, tmp_path), capsys)
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert message in line
    assert not (tmp_path / "out").exists()


# --- the update is the one intended: the sampler's log-probs, the mask, a one-prompt bandit --------------------


def test_the_update_scores_the_sampled_tokens_as_the_sampler_drew_them(micro_data, policy):
    """The rollout's training rows hold the sampled tokens under the completion mask, and the
    log-probs the update computes from them (teacher-forced, whole rows) equal the ones the
    KV-cache sampler drew them with: same positions, segments, padding and mask."""
    # two updates per rollout: the update's old log-probs are then the policy's own, scored as the loss scores them
    change = {"prompts_per_step": 8, "group_size": 4, "anchor_coef": 0.0, "updates_per_rollout": 2}
    cfg = grpo_section(**change)
    tasks, _ = rollout_sets(micro_data / "raw", cfg)
    model = load_model(policy)
    gen = Generator(model, load_tokenizer(policy / "tokenizer.json"), read_model_context(policy))
    rollouts = Rollouts(cfg, gen, nnx.graphdef(model), tasks, seed=0)
    prompts = [rollouts.prompts[i] for i in rollouts.prompt_indices(0, 8) for _ in range(4)]
    tokens, seg, pos = gen.layout(prompts, cfg.max_new_tokens)
    stop = gen.stop_mask(chat=True, stop_at_newline=True)
    key = jax.random.fold_in(jax.random.key(0), 0)  # rollout 0's key
    sampled, stats = gen.decode(
        gen.params, tokens, seg, pos, stop, key, Sampling(1.0), cfg.max_new_tokens, logprobs=True
    )
    rollouts.draw(gen.params)
    batch, width = rollouts.batch, tokens.shape[1]
    mask = batch["completion_mask"].astype(bool)
    assert not mask[:, :width].any() and mask.sum(1).min() >= 1  # no prompt or pad token trains; every row has one
    np.testing.assert_array_equal(batch["tokens"][:, :width], tokens)
    np.testing.assert_array_equal(batch["tokens"][:, width:][mask[:, width:]], np.asarray(sampled)[mask[:, width:]])
    assert (batch["segment_ids"][mask] == 1).all()
    np.testing.assert_allclose(batch["old_logp"][mask], np.asarray(stats["logp"])[mask[:, width:]], atol=1e-4)
    adv = batch["advantages"]  # one value per row: the loss reads it only under the mask
    assert (adv == adv[:, :1]).all()


@pytest.mark.parametrize("objective", ["grpo", "rft"])
def test_a_one_prompt_bandit_learns_the_rewarded_answer(micro_data, tmp_path, objective):
    """One prompt, two answers the policy gives equally often, one rewarded: the GRPO update, and
    the next-token loss on the correct samples (rft), drive the rewarded answer's probability from
    about a half to nearly one."""
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    task = arithmetic_task(23, "plus", 58)
    right, wrong = task.chat_answer, working(23, "plus", 57)  # "... so 81." and "... so 80."
    answers = [
        chat_segments(tok, [{"role": "user", "content": task.chat_prompt}, {"role": "assistant", "content": a}])
        for a in (right, wrong)
    ]
    width = max(len(ids) for ids, _ in answers)
    rows = {k: np.zeros((2, width), np.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    for i, (ids, mask) in enumerate(answers):
        rows["tokens"][i, : len(ids)], rows["loss_mask"][i, : len(ids)] = ids, mask
        rows["segment_ids"][i, : len(ids)], rows["positions"][i, : len(ids)] = 1, np.arange(len(ids))
    cfg = DecoderConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    model = Decoder(cfg, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def teach(model, optimizer, rows):  # both answers, equally
        loss, grads = nnx.value_and_grad(lambda m: lm_loss(m, rows, None)[0])(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def answer_logp(model, rows):
        inputs, targets, weights = next_token_targets(rows)
        logp = token_logprobs(model(inputs["tokens"], inputs["segment_ids"], inputs["positions"]), targets)
        return jnp.sum(logp * weights, axis=1)

    def share_right(model) -> float:
        logp = np.asarray(answer_logp(model, rows), np.float64)
        return float(np.exp(logp[0] - np.logaddexp(logp[0], logp[1])))

    for _ in range(150):
        teach(model, optimizer, rows)
    before = share_right(model)
    assert 0.25 < before < 0.75, before

    change = {"prompts_per_step": 4, "group_size": 8, "steps": 20, "eval_every": 20, "checkpoint_every": 20}
    change |= {"updates_per_rollout": 1, "lr": 3e-3, "warmup_steps": 1, "kl_coef": 0.0, "anchor_coef": 0.0}
    change |= {"max_new_tokens": 40, "dynamic_sampling": False}  # the worked answer is 26 tokens; the plain rollout
    change |= {"objective": objective}
    grpo = load_section(micro_params(grpo=change), "grpo")
    rl = [{"family": "arithmetic", "chat_prompt": task.chat_prompt, "spec": json.dumps(task.spec)}]
    gen = Generator(model, tok, 128)
    rollouts = Rollouts(grpo, gen, nnx.graphdef(model), rl, seed=0)
    result = train(
        model,
        grpo,
        None,
        PackedRows(micro_data / "packed/val"),
        TrainRun(0, make_mesh(1, 1, 1, jax.devices()[:1]), tmp_path / "out", tmp_path / "ckpt", "bandit", {}, {}),
        loss_fn=grpo_loss(grpo.clip_eps, 0.0, objective=objective),
        eval_loss_fn=lm_loss,
        batches=rollouts,
    )
    after = share_right(result.model)
    assert after > 0.95, (before, after)
    rewards = [r["rollout/reward"] for r in result.history if "rollout/reward" in r]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]), rewards  # other tokens sampled at T=1 still miss
    logged = {r["step"]: r["train/lr"] for r in result.history if "train/lr" in r}
    assert logged and logged == {s: float(lr_schedule(grpo)(s - 1)) for s in logged}  # the optimizer's own rate


def test_dynamic_sampling_fills_the_update_with_groups_that_differ(micro_data, policy):
    """Groups whose samples all scored alike make way for freshly drawn prompts; the first draw is
    the plain rollout's, so the kept groups begin with its mixed ones, in order."""
    change = {"families": ["uses_word"], "format_weight": 1.0, "prompts_per_step": 8, "group_size": 4}
    change |= {"anchor_coef": 0.0, "max_new_tokens": 12, "max_draws": 4}
    model = load_model(policy)
    gen = Generator(model, load_tokenizer(policy / "tokenizer.json"), read_model_context(policy))

    def rollout(dynamic: bool) -> tuple[dict, dict]:
        cfg = grpo_section(**change, dynamic_sampling=dynamic)
        rollouts = Rollouts(cfg, gen, nnx.graphdef(model), rollout_sets(micro_data / "raw", cfg)[0], seed=0)
        metrics = rollouts.draw(gen.params)
        return metrics, rollouts.batch

    plain_metrics, plain = rollout(False)
    metrics, dynamic = rollout(True)
    first = plain["advantages"][:, 0].reshape(8, 4)
    mixed = np.flatnonzero(np.ptp(first, axis=1) > 0)
    assert 0 < len(mixed) < 8, first  # some groups teach nothing: the case dynamic sampling is for
    assert plain_metrics["rollout/prompts_drawn"] == 8 and metrics["rollout/prompts_drawn"] in (16, 24, 32)
    groups = dynamic["advantages"][:, 0].reshape(8, 4)
    mixed_drawn = round(metrics["rollout/mixed_groups"] * metrics["rollout/prompts_drawn"])
    assert (np.ptp(groups, axis=1) > 0).sum() == min(8, mixed_drawn), groups  # as many differ as could
    rows = np.concatenate([np.arange(g * 4, g * 4 + 4) for g in mixed])
    completions = np.s_[: len(rows), -12:]  # the last max_new_tokens columns (the prompts' width may differ)
    np.testing.assert_array_equal(dynamic["tokens"][completions], plain["tokens"][rows, -12:])
    np.testing.assert_array_equal(groups[: len(mixed)], first[mixed])


def test_unsure_prompts_by_hand():
    """The prompts whose samples scored differently, the lowest mean reward first, then in draw order."""
    rows = np.zeros((4, 3), np.int32)
    rewards = {7: [1, 1, 1, 1], 3: [1, 0, 1, 1], 9: [0, 0, 1, 0], 4: [0, 0, 0, 0], 1: [0, 1, 1, 1], 2: [1, 0, 0, 0]}
    rewards |= {8: [0.5, 0.5, 0.5, 0.5], 6: [0.5, 0, 0, 0]}  # partial credit (reward: steps)
    groups = [Group(i, rows, [float(r) for r in got], [], [], [], []) for i, got in rewards.items()]
    assert unsure_prompts(groups) == [6, 9, 2, 3, 1]


def test_revisit_samples_the_last_rollouts_unsure_prompts_first(micro_data, policy):
    """With `revisit` a rollout's first batch begins with up to that share of the last rollout's
    unsure prompts, and fresh prompts of the seeded stream fill the rest; what it finds unsure is
    what the next one revisits."""
    change = {"families": ["uses_word"], "prompts_per_step": 8, "group_size": 4, "anchor_coef": 0.0}
    change |= {"max_new_tokens": 12, "dynamic_sampling": False, "revisit": 0.5}
    change |= {"format_weight": 1.0}  # a reward the micro policy earns on some samples and not others
    model = load_model(policy)
    gen = Generator(model, load_tokenizer(policy / "tokenizer.json"), read_model_context(policy))
    cfg = grpo_section(**change)
    rollouts = Rollouts(cfg, gen, nnx.graphdef(model), rollout_sets(micro_data / "raw", cfg)[0], seed=0)
    rollouts.unsure = [5, 1, 6, 0, 2]  # as if the last rollout had found these unsure
    metrics = rollouts.draw(gen.params)
    assert metrics["rollout/prompts_revisited"] == 4
    expected = [5, 1, 6, 0, *rollouts.prompt_indices(0, 4)]
    tokens, _, _ = gen.layout([rollouts.prompts[i] for i in expected for _ in range(4)], 12)
    np.testing.assert_array_equal(rollouts.batch["tokens"][:, : tokens.shape[1]], np.asarray(tokens))
    assert rollouts.drawn == 4 and metrics["rollout/samples_seen"] == 8 * 4  # the stream moved on by the fresh four
    # without dynamic sampling the batch is the drawn groups in order: a group scored differently where its
    # advantages differ, and those prompts, each once, are the next rollout's to revisit
    differ = np.ptp(rollouts.batch["advantages"][:, 0].reshape(8, 4), axis=1) > 0
    assert 0 < differ.sum() < 8, differ
    assert sorted(rollouts.unsure) == sorted(expected[g] for g in np.flatnonzero(differ))
    revisited_next = rollouts.unsure[:4]
    rollouts.draw(gen.params)
    again = [*revisited_next, *rollouts.prompt_indices(4, 8 - len(revisited_next))]
    tokens, _, _ = gen.layout([rollouts.prompts[i] for i in again for _ in range(4)], 12)
    np.testing.assert_array_equal(rollouts.batch["tokens"][:, : tokens.shape[1]], np.asarray(tokens))


def test_the_rollout_summary_gives_both_phases_speed_and_the_updates_mfu_against_a_peak():
    from stagelm.post.rollouts import rollout_summary

    history = [
        {"rollout/reward": 0.5, "rollout/accuracy": 0.5, "rollout/entropy": 1.0, "rollout/samples_seen": 256.0 * i}
        | {"perf/rollout_tokens_per_sec": 1000.0 * i}
        | ({"perf/update_tokens_per_sec": 10.0 * i, "perf/update_flops_per_sec": 2e12 * i} if i > 1 else {})
        for i in range(1, 5)
    ]
    summary = rollout_summary(history, peak=1e13)
    assert summary["rollout_tokens_per_sec"] == 2500.0 and summary["update_tokens_per_sec"] == 30.0
    assert summary["update_mfu"] == pytest.approx(0.6) and summary["samples"] == 1024.0
    assert rollout_summary(history)["update_mfu"] is None  # no published peak (a CPU)
