"""GRPO: reinforcement learning with rewards a program computes (Shao et al., 2024, DeepSeekMath).

Each rollout takes `prompts_per_step` prompts of the rl task set, samples
`group_size` completions of each with the KV-cache engine, scores them with the task
family's checker (1 for a correct answer, plus `format_weight` for a well-formed one)
and normalises each reward within its group: advantage = (r − mean) / (std + 1e-6), or
r − mean with `advantages: none` (Dr. GRPO, Liu et al. 2025: the std favours prompts
that are nearly always or nearly never solved). With `dynamic_sampling` (DAPO, Yu et al.
2025) groups whose samples all scored alike, which teach nothing, make way for more prompts.
The loss per completion token is the clipped importance-ratio objective of PPO (with
DAPO's higher upper clip when `clip_eps_high` is set) plus
a KL penalty to the frozen reference (the k3 estimator, exp(q − p) − (q − p) − 1 with
p, q the policy's and the reference's log-probs), summed over completion tokens and
divided by their count. `updates_per_rollout` optimizer steps reuse each rollout; the
first of them is on-policy, so its ratio is exactly 1 (old log-probs are the current
ones, gradient stopped) and the loss is the plain policy-gradient loss.

`anchor_coef` > 0 adds that weight times the mean k3 penalty over the assistant tokens
of `anchor_rows` SFT conversations of the families the reward does not target, against
the reference's log-probs of the same tokens: a regulariser in the manner of
InstructGPT's PPO-ptx that holds the other families where SFT left them, without
training on them (it is zero at the reference and cannot raise their likelihood).

The rollouts themselves (sampling, scoring, layout) are `stagelm.post.rollouts`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stagelm.train.step import LossFn, next_token_targets


def group_advantages(rewards: np.ndarray, scale: str = "group") -> np.ndarray:
    """(prompts, group) rewards → advantages: each reward less its group's mean, divided by the
    group's std with `scale` "group" (GRPO) or not with "none" (Dr. GRPO); 0 where all agree."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if scale == "none":
        return centred
    return centred / (rewards.std(axis=1, keepdims=True) + 1e-6)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def grpo_loss(
    clip_eps: float,
    kl_coef: float,
    anchor_coef: float = 0.0,
    clip_eps_high: float | None = None,
    objective: str = "grpo",
    entropy_coef: float = 0.0,
) -> LossFn:
    """The clipped-ratio loss with a KL penalty, over completion tokens; aux: clip fraction, ratio
    and, with `kl_coef` > 0, the k3 KL to the reference (the batch's `ref_logp`; absent when 0).

    The ratio is clipped to [1 − clip_eps, 1 + clip_eps_high] (DAPO's decoupled clip; the
    upper bound is clip_eps when `clip_eps_high` is None). With `objective` "rft" the policy
    term is the next-token loss of the tokens under the mask (the rollout's kept correct
    samples) times their row's weight, with no ratio: rejection-sampling fine-tuning.

    With `anchor_coef` > 0 the batch also carries anchor rows (`anchor_*`: SFT rows and
    the reference's log-probs of their answer tokens) and the loss adds `anchor_coef`
    times their mean k3 penalty, which holds the policy's answers to the prompts the
    reward does not target where the reference had them.

    `entropy_coef` subtracts that weight times the policy's entropy (of its whole next-token
    distribution) at each completion token: > 0 pays for exploring, < 0 for sharpening.
    """

    def loss(model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
        inputs, targets, _ = next_token_targets(batch)
        logits = model(inputs["tokens"], inputs["segment_ids"], inputs["positions"], rng)
        logp = token_logprobs(logits, targets)
        mask = batch["completion_mask"][:, 1:].astype(jnp.float32)
        adv = batch["advantages"][:, 1:]
        fresh = batch["on_policy"][:, 1:] > 0
        old = jnp.where(fresh, jax.lax.stop_gradient(logp), batch["old_logp"][:, 1:])
        ratio = jnp.exp(logp - old)
        high = clip_eps if clip_eps_high is None else clip_eps_high
        clipped = jnp.clip(ratio, 1 - clip_eps, 1 + high)
        policy = -logp * adv if objective == "rft" else -jnp.minimum(ratio * adv, clipped * adv)
        per_token = policy
        if kl_coef:  # with no penalty the rollouts carry no reference log-probs (TRL's beta 0 alike)
            kl = k3(batch["ref_logp"][:, 1:], logp)
            per_token = policy + kl_coef * kl
        if entropy_coef:
            per_token -= entropy_coef * entropy(logits)
        was_clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + high)).astype(jnp.float32)
        count = jnp.sum(mask)
        aux = {"clip_fraction": jnp.sum(was_clipped * mask), "ratio": jnp.sum(ratio * mask)}
        if kl_coef:
            aux["kl"] = jnp.sum(kl * mask)
        total = jnp.sum(per_token * mask)
        if anchor_coef > 0:
            rows = {k.removeprefix("anchor_"): v for k, v in batch.items() if k.startswith("anchor_")}
            a_inputs, a_targets, a_weights = next_token_targets(rows)
            a_logits = model(a_inputs["tokens"], a_inputs["segment_ids"], a_inputs["positions"], rng)
            a_kl = jnp.sum(k3(rows["ref_logp"][:, 1:], token_logprobs(a_logits, a_targets)) * a_weights)
            a_mean = a_kl / jnp.maximum(jnp.sum(a_weights), 1.0)
            total += anchor_coef * a_mean * count  # the train loop divides by count
            aux["anchor_kl"] = a_mean * count
        return total, count, aux

    return loss


def entropy(logits: jax.Array) -> jax.Array:
    """The entropy of each position's next-token distribution, in nats: (..., vocab) → (...)."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.sum(jnp.exp(logq) * logq, axis=-1)


def k3(ref_logp: jax.Array, logp: jax.Array) -> jax.Array:
    """Schulman's k3 estimate of KL(policy ‖ reference) per token: e^(q−p) − (q−p) − 1 ≥ 0."""
    delta = ref_logp - logp
    return jnp.exp(delta) - delta - 1
