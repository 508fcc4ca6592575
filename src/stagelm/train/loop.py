"""The one training loop every training stage runs: pretrain, SFT, distill, GRPO.

    result = train(model, cfg, train_rows, val_rows, run)          # run: stagelm.train.run.TrainRun

It places the state on the mesh, resumes from the fingerprint's last checkpoint,
steps the jitted train step over the batches, evaluates, checkpoints, logs through
dvclive and stops on a non-finite loss with the last good checkpoint kept. What
differs between stages is the model, which variables train (`trainable`), the loss
function and where batches come from: packed rows through Grain by default, or any
`BatchSource` (GRPO's rollouts of the current policy).

Metrics reach the host one step late: step i's loss is read after step i+1 was
dispatched, so the device never waits for the host.
"""

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from stagelm.data.loader import MixedRows, PackedRows
from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.infra.mesh import param_shardings, replicated
from stagelm.pipeline.config import OptimizerConfig
from stagelm.train.batches import BatchSource, PackedBatches, check_batch, evaluate, global_batch
from stagelm.train.checkpoints import Checkpoints, other_fingerprints
from stagelm.train.metrics import MetricLog
from stagelm.train.run import TrainRun
from stagelm.train.step import (
    LossFn,
    TrainState,
    init_state,
    lm_loss,
    lr_schedule,
    make_eval_step,
    make_optimizer,
    make_train_step,
)
from stagelm.train.timer import StepTimer, summarize


@dataclasses.dataclass
class TrainResult:
    model: nnx.Module
    history: list[dict[str, float]]
    summary: dict[str, Any]
    resumed_from: int | None


def shard_state(model: nnx.Module, trainable: Any, mesh: jax.sharding.Mesh) -> tuple[Any, Any, Any, Any]:
    """(graphdef, params, frozen, params shardings) of `model`, placed on `mesh`."""
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    p_sh, f_sh = param_shardings(params, mesh), param_shardings(frozen, mesh)
    return graphdef, jax.device_put(params, p_sh), jax.device_put(frozen, f_sh), p_sh


def state_shardings(tx: Any, params: Any, p_sh: Any, mesh: jax.sharding.Mesh) -> TrainState:
    """Shardings of the whole TrainState: optimizer moments shard like their params."""
    import optax

    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        p_sh,
        transform_non_params=lambda _: replicated(mesh),
    )
    return TrainState(p_sh, opt_sh, replicated(mesh), replicated(mesh))


@dataclasses.dataclass
class Placed:
    """A model placed on the mesh for training: its split state and the compiled functions over it."""

    graphdef: Any
    state: TrainState
    frozen: Any
    step_fn: Any  # (state, frozen, batch) -> (state, metrics), the state donated
    eval_fn: Any  # (params, frozen, batch) -> (loss sum, tokens)
    schedule: Any  # step index -> learning rate: the optimizer's own, which the log reads


def place(
    model: nnx.Module, cfg: OptimizerConfig, run: TrainRun, trainable: Any, loss_fn: LossFn, eval_loss_fn: LossFn
):
    """Split `model` into what trains and what stays frozen, shard both on the run's mesh, and
    build the optimizer state and the jitted train and eval steps."""
    mesh = run.mesh
    graphdef, params, frozen, p_sh = shard_state(model, trainable, mesh)
    schedule = lr_schedule(cfg)
    tx = make_optimizer(cfg, params, schedule)
    st_sh = state_shardings(tx, params, p_sh, mesh)
    state = jax.jit(lambda p: init_state(p, tx, jax.random.key(run.seed)), out_shardings=st_sh)(params)
    step_fn = make_train_step(graphdef, tx, loss_fn, out_shardings=(st_sh, replicated(mesh)))
    return Placed(graphdef, state, frozen, step_fn, make_eval_step(graphdef, eval_loss_fn), schedule)


def resume(ckpt: Checkpoints, run: TrainRun, state: TrainState, data: BatchSource, timer: StepTimer):
    """(state, metric history, step resumed from or None): the run's last checkpoint restored into
    `state`, `data` and `timer`, or the fresh state, saying which and why."""
    resumed = ckpt.latest_step()
    if resumed is None:
        others = other_fingerprints(run.checkpoint_root, run.fingerprint)
        why = (
            f"checkpoints exist only for other fingerprints {others} (code, params or inputs changed)"
            if others
            else "no checkpoint yet"
        )
        print(f"starting fresh at step 0: {why}", flush=True)
        return state, [], None
    state, extra = ckpt.restore(resumed, state)
    data.set_state(extra["loader"])
    timer.set_state(extra.get("timer"))
    print(f"resuming from step {resumed} (checkpoint {ckpt.directory})", flush=True)
    return state, extra["history"], resumed


def step_row(step: int, metrics: dict, host: dict, lr: float, rate: float | None) -> dict[str, float]:
    """The logged row of a finished step: its train metrics, the host's (rollouts) and the speed."""
    row = {
        "step": step,
        "train/loss": float(metrics["loss"]),
        "train/grad_norm": float(metrics["grad_norm"]),
        "train/lr": lr,
        "train/tokens": float(metrics["tokens"]),
        **{f"train/{k}": float(v) for k, v in metrics.items() if k not in ("loss", "grad_norm", "tokens")},
        **host,
    }
    if rate is not None:
        row["perf/tokens_per_sec"] = rate
    return row


def train(
    model: nnx.Module,
    cfg: OptimizerConfig,
    train_rows: PackedRows | MixedRows | None,
    val_rows: PackedRows,
    run: TrainRun,
    *,
    trainable: Any = nnx.Param,
    loss_fn: LossFn = lm_loss,
    eval_loss_fn: LossFn | None = None,
    batches: BatchSource | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
) -> TrainResult:
    """Train `model` for `cfg.steps` steps (resuming when the run's checkpoint exists) and return it.

    `eval_loss_fn` (default `loss_fn`) gives val/loss on `val_rows`; `batches` (default:
    `train_rows` through Grain) gives the training batches. `cfg` is a stage's section
    (training, sft, distill or grpo) with its `batch_size` and `grad_accum`; errors name its keys.
    """
    check_batch(cfg.batch_size, run.mesh, cfg.batch_key)  # before any compile: one line, not JAX's IndivisibleError
    if train_rows is not None and cfg.batch_size * cfg.grad_accum > len(train_rows):
        raise StagelmError(
            f"{cfg.batch_key}: {cfg.batch_size} × {cfg.section}.grad_accum {cfg.grad_accum} rows per step, but the "
            f"training data holds {len(train_rows)} rows; lower it or pack more data"
        )
    with jax.set_mesh(run.mesh):
        placed = place(model, cfg, run, trainable, loss_fn, eval_loss_fn or loss_fn)
        local_rows = cfg.batch_size * cfg.grad_accum // jax.process_count()
        data = batches or PackedBatches(train_rows, local_rows, run.seed)
        ckpt = Checkpoints(run.checkpoint_root / run.fingerprint, cfg.keep_checkpoints)
        timer = StepTimer()
        placed.state, history, resumed = resume(ckpt, run, placed.state, data, timer)
        log = MetricLog(
            run.out_dir, history, total_steps=cfg.steps, log_every=cfg.log_every, writer=jax.process_index() == 0
        )
        step_loop(placed, cfg, run, data, val_rows, ckpt, log, timer)
        ckpt.close()

    model = nnx.merge(placed.graphdef, placed.state.params, placed.frozen)
    summary = summarize(log.history, timer, flops_per_token, peak_flops)
    log.close(summary)
    return TrainResult(model, log.history, summary, resumed)


def step_loop(
    placed: Placed,
    cfg: OptimizerConfig,
    run: TrainRun,
    data: BatchSource,
    val_rows: PackedRows,
    ckpt: Checkpoints,
    log: MetricLog,
    timer: StepTimer,
) -> None:
    """Steps from the state's step to `cfg.steps`: train, log a step late, evaluate and checkpoint."""
    start = int(placed.state.step)
    pending: tuple[int, dict, dict] | None = None
    host_before = False

    def finish_step(step: int, metrics: dict, host: dict) -> None:
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            kept = ckpt.latest_step()
            raise StagelmError(
                f"training: loss is {loss} at step {step}; last good checkpoint: "
                f"{'step ' + str(kept) if kept is not None else 'none'} in {ckpt.directory}; lower {cfg.section}.lr"
            )
        log.add(step_row(step, metrics, host, float(placed.schedule(step - 1)), timer.rate()))

    for step in range(start + 1, cfg.steps + 1):
        local, host = data.next(placed.state.params, placed.frozen)
        rows, row_len = local["tokens"].shape
        timer.tokens_per_step = rows * (row_len - 1) * jax.process_count()
        if host or host_before:
            timer.pause()  # host-side work (rollouts) is not the train step's time
        host_before = bool(host)
        batch = global_batch(local, cfg.grad_accum, run.mesh)
        if step == start + 1:  # compiles the step (the call below reuses it) and checks its memory
            require_step_memory(
                placed.step_fn, placed.state, placed.frozen, batch, f"{cfg.batch_key} (or pack.seq_len)"
            )
        placed.state, metrics = placed.step_fn(placed.state, placed.frozen, batch)
        jax.block_until_ready(metrics)  # the step's real time, not its dispatch's
        timer.tick(step == start + 1)
        if pending is not None:
            finish_step(*pending)
        pending = (step, metrics, host)
        is_eval = step % cfg.eval_every == 0 or step == cfg.steps
        if is_eval or step % cfg.checkpoint_every == 0:
            finish_step(*pending)
            pending = None
        last_val = None
        if is_eval:
            args = (placed.state.params, placed.frozen, val_rows, cfg.batch_size, cfg.eval_batches, run.mesh)
            last_val, _ = evaluate(placed.eval_fn, *args)
            log.add_to_last({"val/loss": last_val})
            timer.pause()
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            extra = {"loader": data.get_state(), "history": log.history, "timer": timer.get_state()}
            ckpt.save(step, placed.state, extra, last_val)
            timer.pause()
    if pending is not None:
        finish_step(*pending)


def require_step_memory(step_fn: Any, state: Any, frozen: Any, batch: Any, key: str) -> None:
    """Compile the train step for these arguments and refuse, naming `key`, a step whose
    buffers (XLA's own figures: temporaries and outputs, less what reuses donated inputs)
    do not fit in the memory left beside the state already placed."""
    stats = step_fn.lower(state, frozen, batch).compile().memory_analysis()
    if stats is None:  # a backend without the analysis
        return
    need = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    rows, row_len = next(iter(batch.values())).shape[-2:]
    require_memory(max(need, 0), key, f"a train step of {rows} rows × {row_len} tokens")
