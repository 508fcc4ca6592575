"""Training math: losses, the optimizer, and one jitted, donated train step.

The state is a pytree (`TrainState`) threaded through pure functions:
`step(state, frozen, batch) -> (state, metrics)`. `params` holds what is trained
and `frozen` what is not (empty for pretraining; the base weights for LoRA), so one
step serves every training stage: only the loss function changes.

A batch is a dict of (grad_accum, batch_size, seq_len + 1) arrays. Gradients of the
token-weighted loss sum are accumulated over microbatches with `lax.scan` and
divided by the total weight at the end, so k microbatches give the same update as one
batch k times larger.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from stagelm.pipeline.config import OptimizerConfig

# (model, batch, rng) -> (loss sum, weight) or (loss sum, weight, {name: sum}); the step reports
# each aux sum divided by the weight, like the loss.
LossFn = Callable[[nnx.Module, dict[str, jax.Array], jax.Array | None], tuple]


class TrainState(NamedTuple):
    params: Any  # nnx.State of the trained Variables
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # PRNG key, split once per step


def next_token_targets(batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """(model inputs, targets, weights) of packed rows of seq_len + 1 tokens.

    A prediction counts when its target is a real token of the same segment as the
    input (no padding, no jump across a document boundary) and, when the rows carry
    a `loss_mask`, when the target is marked for training (assistant tokens in SFT).
    """
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    inputs = {"tokens": tokens[:, :-1], "segment_ids": seg[:, :-1], "positions": pos[:, :-1]}
    weights = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    if "loss_mask" in batch:
        weights = weights & (batch["loss_mask"][:, 1:] != 0)
    return inputs, tokens[:, 1:], weights.astype(jnp.float32)


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropy over counted tokens, number of counted tokens)."""
    inputs, targets, weights = next_token_targets(batch)
    logits = model(inputs["tokens"], inputs["segment_ids"], inputs["positions"], rng).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weights), jnp.sum(weights)


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """constant, cosine or warmup-stable-decay (Hu et al., 2024, MiniCPM), each after linear warmup."""
    floor = cfg.lr * cfg.min_lr_ratio
    warm = max(cfg.warmup_steps, 1)
    warmup = optax.linear_schedule(cfg.lr / warm, cfg.lr, warm - 1)
    rest = max(cfg.steps - warm, 1)  # the main part ends at index steps - 1, the last update
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr_ratio)
    else:
        decay = max(1, round(rest * cfg.decay_fraction))
        main = optax.join_schedules(
            [optax.constant_schedule(cfg.lr), optax.linear_schedule(cfg.lr, floor, decay)], [rest - decay]
        )
    return optax.join_schedules([warmup, main], [warm - 1])


def decay_mask(params: Any, decay_embeddings: bool) -> Any:
    """True for weights that get weight decay: matrices, and embeddings only when asked; never norms."""

    def decays(path: tuple, leaf: jax.Array) -> bool:
        name = str(path[-2].key if hasattr(path[-2], "key") else path[-2]) if len(path) > 1 else ""
        if leaf.ndim < 2:
            return False
        return decay_embeddings or name not in ("embed", "head")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
    cfg: OptimizerConfig, params: Any, schedule: optax.Schedule | None = None
) -> optax.GradientTransformation:
    """AdamW on the section's schedule (`schedule`, by default `lr_schedule(cfg)`: a caller that logs
    the rate passes the one it reads), after global-norm clipping; or, where the section asks for
    `optimizer: sgd` (grpo), SGD with momentum beta1 and the same decoupled weight decay."""
    mask = decay_mask(params, cfg.decay_embeddings)
    schedule = lr_schedule(cfg) if schedule is None else schedule
    if getattr(cfg, "optimizer", "adamw") == "sgd":
        opt = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask),
            optax.sgd(schedule, momentum=cfg.beta1 or None),
        )
    else:
        opt = optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt) if cfg.grad_clip > 0 else opt


def init_state(params: Any, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32), rng=rng)


def accumulate_grads(loss_and_grad: Callable, params: Any, batch: dict, rng: jax.Array) -> tuple:
    """Sum ((loss, weight, aux), grads) over the leading microbatch axis of `batch`."""
    n_micro = jax.tree.leaves(batch)[0].shape[0]
    if n_micro == 1:
        return loss_and_grad(params, jax.tree.map(lambda x: x[0], batch), rng)

    def body(carry: tuple, micro: tuple) -> tuple:
        mb, key = micro
        return jax.tree.map(jnp.add, carry, loss_and_grad(params, mb, key)), None

    first = jax.eval_shape(loss_and_grad, params, jax.tree.map(lambda x: x[0], batch), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
    keys = jax.random.split(rng, n_micro)
    total, _ = jax.lax.scan(body, zeros, (batch, keys))
    return total


def loss_parts(out: tuple) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(loss sum, weight, aux sums) of a loss function's result; aux is optional."""
    return (out[0], out[1], out[2]) if len(out) == 3 else (out[0], out[1], {})


def make_train_step(
    graphdef: Any, tx: optax.GradientTransformation, loss_fn: LossFn = lm_loss, out_shardings: Any = None
) -> Callable:
    """A jitted `step(state, frozen, batch) -> (state, metrics)` that donates `state`."""

    def sum_loss(params: Any, frozen: Any, batch: dict, rng: jax.Array) -> tuple:
        model = nnx.merge(graphdef, params, frozen)
        loss, weight, aux = loss_parts(loss_fn(model, batch, rng))
        return loss, (loss, weight, aux)

    def step(state: TrainState, frozen: Any, batch: dict) -> tuple[TrainState, dict]:
        rng, step_rng = jax.random.split(state.rng)
        grad_fn = jax.grad(sum_loss, has_aux=True)

        def loss_and_grad(params: Any, micro: dict, key: jax.Array) -> tuple:
            grads, aux = grad_fn(params, frozen, micro, key)
            return aux, grads

        (loss, weight, aux), grads = accumulate_grads(loss_and_grad, state.params, batch, step_rng)
        denom = jnp.maximum(weight, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss / denom, "tokens": weight, "grad_norm": optax.tree.norm(grads)}
        metrics.update({name: value / denom for name, value in aux.items()})
        return TrainState(params, opt_state, state.step + 1, rng), metrics

    if out_shardings is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)


def make_eval_step(graphdef: Any, loss_fn: LossFn = lm_loss) -> Callable:
    """A jitted `eval_step(params, frozen, batch) -> (loss sum, weight)` over one (B, L) batch."""

    def eval_step(params: Any, frozen: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
        loss, weight, _ = loss_parts(loss_fn(nnx.merge(graphdef, params, frozen), batch, None))  # no rng: no dropout
        return loss, weight

    return jax.jit(eval_step)
