"""The one training loop every training stage runs: pretrain, SFT, distill, GRPO.

It places the state on the mesh, resumes from the fingerprint's last checkpoint,
steps the jitted train step over Grain batches, evaluates, checkpoints, logs
through dvclive and stops on a non-finite loss with the last good checkpoint kept.
What differs between stages is the model, which variables train (`trainable`), the
loss function and where batches come from: packed rows through Grain by default,
or any `BatchSource` (GRPO's rollouts of the current policy).

Metrics reach the host one step late: step i's loss is read after step i+1 was
dispatched, so the device never waits for the host.

`start_training` and `record_training` are the frame of the four training stage
scripts: the command line, joining the other processes, the mesh, and the
provenance record of the run.
"""

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

from stagelm.data.loader import MixedRows, PackedRows, batch_iterator
from stagelm.infra.devices import describe_devices
from stagelm.infra.distributed import initialize
from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.infra.mesh import make_mesh, param_shardings, replicated
from stagelm.pipeline.config import OptimizerConfig
from stagelm.pipeline.params import load_section
from stagelm.pipeline.stage import Stage, start
from stagelm.train.batches import check_batch, evaluate, global_batch
from stagelm.train.checkpoints import Checkpoints, other_fingerprints
from stagelm.train.metrics import MetricLog
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


class BatchSource(Protocol):
    """Where a training stage's batches come from; its state is saved in every checkpoint."""

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """(this process's rows as (rows, L) arrays, host metrics for the step's log row)."""
        ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


class PackedBatches:
    """Batches of packed rows: a seeded, process-sharded, checkpointable Grain iterator."""

    def __init__(self, rows: PackedRows, local_rows: int, seed: int):
        self.it = batch_iterator(
            rows, local_rows, seed, shard_index=jax.process_index(), shard_count=jax.process_count()
        )

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        return next(self.it), {}

    def get_state(self) -> dict[str, Any]:
        return self.it.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.it.set_state(state)


@dataclasses.dataclass
class TrainResult:
    model: nnx.Module
    history: list[dict[str, float]]
    summary: dict[str, Any]
    resumed_from: int | None


def start_training(
    doc: str | None, *paths: str, options: dict[str, dict[str, Any]] | None = None
) -> tuple[Stage, jax.sharding.Mesh]:
    """A training stage's start: its command line (`stage.start`), joining jax.distributed
    when launched as one of several processes, and the mesh params.yaml's `mesh` asks for."""
    stage = start(doc, *paths, options=options)
    initialize(load_section(stage.params, "launch").initialization_timeout)
    mesh_cfg = load_section(stage.params, "mesh")
    return stage, make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)


def record_training(
    stage: Stage, result: TrainResult, fingerprint: str, read: dict, inputs: dict, **extra: Any
) -> None:
    """provenance.json of a training run (process 0 writes it): the run's fingerprint, where
    it resumed, its devices and summary, and `extra`."""
    if jax.process_index() == 0:
        run = {"fingerprint": fingerprint, "resumed_from": result.resumed_from, "devices": describe_devices()}
        stage.record(stage.args.out / "provenance.json", read, inputs, {**run, "summary": result.summary, **extra})


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


def train(
    model: nnx.Module,
    cfg: OptimizerConfig,
    train_rows: PackedRows | MixedRows | None,
    val_rows: PackedRows,
    *,
    seed: int,
    mesh: jax.sharding.Mesh,
    out_dir: Path,
    checkpoint_root: Path,
    fingerprint: str,
    trainable: Any = nnx.Param,
    loss_fn: LossFn = lm_loss,
    eval_loss_fn: LossFn | None = None,
    batches: BatchSource | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
) -> TrainResult:
    """Train `model` for `cfg.steps` steps (resuming when a checkpoint exists) and return it.

    `eval_loss_fn` (default `loss_fn`) gives val/loss on `val_rows`; `batches` (default:
    `train_rows` through Grain) gives the training batches. `cfg` is a stage's section
    (training, sft, distill or grpo) with its `batch_size` and `grad_accum`; errors name its keys.
    """
    batch_key = "grpo.prompts_per_step" if cfg.section == "grpo" else f"{cfg.section}.batch_size"
    check_batch(cfg.batch_size, mesh, batch_key)  # before any compile: one line, not JAX's IndivisibleError
    with jax.set_mesh(mesh):
        graphdef, params, frozen, p_sh = shard_state(model, trainable, mesh)
        tx = make_optimizer(cfg, params)
        st_sh = state_shardings(tx, params, p_sh, mesh)
        state = jax.jit(lambda p: init_state(p, tx, jax.random.key(seed)), out_shardings=st_sh)(params)
        step_fn = make_train_step(graphdef, tx, loss_fn, out_shardings=(st_sh, replicated(mesh)))
        eval_fn = make_eval_step(graphdef, eval_loss_fn or loss_fn)
        local_rows = cfg.batch_size * cfg.grad_accum // jax.process_count()
        if train_rows is not None and cfg.batch_size * cfg.grad_accum > len(train_rows):
            raise StagelmError(
                f"{batch_key}: {cfg.batch_size} × {cfg.section}.grad_accum {cfg.grad_accum} rows per step, but the "
                f"training data holds {len(train_rows)} rows; lower it or pack more data"
            )
        data = batches or PackedBatches(train_rows, local_rows, seed)

        ckpt = Checkpoints(checkpoint_root / fingerprint, cfg.keep_checkpoints)
        history, resumed = [], ckpt.latest_step()
        timer = StepTimer()
        if resumed is not None:
            state, extra = ckpt.restore(resumed, state)
            data.set_state(extra["loader"])
            history = extra["history"]
            timer.set_state(extra.get("timer"))
            print(f"resuming from step {resumed} (checkpoint {ckpt.directory})", flush=True)
        else:
            others = other_fingerprints(checkpoint_root, fingerprint)
            why = (
                f"checkpoints exist only for other fingerprints {others} (code, params or inputs changed)"
                if others
                else "no checkpoint yet"
            )
            print(f"starting fresh at step 0: {why}", flush=True)

        log = MetricLog(
            out_dir, history, total_steps=cfg.steps, log_every=cfg.log_every, writer=jax.process_index() == 0
        )
        schedule = lr_schedule(cfg)
        start = int(state.step)
        pending: tuple[int, dict, dict] | None = None
        last_val = None
        host_before = False

        def finish_step(step: int, metrics: dict, host: dict) -> None:
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                kept = ckpt.latest_step()
                raise StagelmError(
                    f"training: loss is {loss} at step {step}; last good checkpoint: "
                    f"{'step ' + str(kept) if kept is not None else 'none'} in {ckpt.directory}; lower {cfg.section}.lr"
                )
            row = {
                "step": step,
                "train/loss": loss,
                "train/grad_norm": float(metrics["grad_norm"]),
                "train/lr": float(schedule(step - 1)),
                "train/tokens": float(metrics["tokens"]),
                **{f"train/{k}": float(v) for k, v in metrics.items() if k not in ("loss", "grad_norm", "tokens")},
                **host,
            }
            rate = timer.rate()
            if rate is not None:
                row["perf/tokens_per_sec"] = rate
            log.add(row)

        for step in range(start + 1, cfg.steps + 1):
            local, host = data.next(state.params, frozen)
            rows, row_len = local["tokens"].shape
            timer.tokens_per_step = rows * (row_len - 1) * jax.process_count()
            if host or host_before:
                timer.pause()  # host-side work (rollouts) is not the train step's time
            host_before = bool(host)
            batch = global_batch(local, cfg.grad_accum, mesh)
            if step == start + 1:  # compiles the step (the call below reuses it) and checks its memory
                require_step_memory(step_fn, state, frozen, batch, f"{batch_key} (or pack.seq_len)")
            state, metrics = step_fn(state, frozen, batch)
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
                last_val, _ = evaluate(eval_fn, state.params, frozen, val_rows, cfg.batch_size, cfg.eval_batches, mesh)
                log.add_to_last({"val/loss": last_val})
                timer.pause()
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                extra = {"loader": data.get_state(), "history": log.history, "timer": timer.get_state()}
                ckpt.save(step, state, extra, last_val)
                timer.pause()
        if pending is not None:
            finish_step(*pending)
        ckpt.close()

    model = nnx.merge(graphdef, state.params, frozen)
    summary = summarize(log.history, timer, flops_per_token, peak_flops)
    log.close(summary)
    return TrainResult(model, log.history, summary, resumed)


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


class StepTimer:
    """Steady-state step times: the first step (compile) and steps after eval/checkpoint pauses are
    excluded. Its state goes into every checkpoint, so a resumed run reports the times of the
    steps before it too, and a run resumed at its last step (`dvc repro -f` of a finished run)
    writes the summary the run had."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.times: list[float] = []
        self.first_call: float | None = None
        self.tokens_per_step = 0
        self.t0 = time.perf_counter()

    def get_state(self) -> dict[str, Any]:
        return {"times": self.times, "first_call": self.first_call, "tokens_per_step": self.tokens_per_step}

    def set_state(self, state: dict[str, Any] | None) -> None:
        if state:  # absent from a checkpoint written before the timer was saved
            self.times, self.first_call = list(state["times"]), state["first_call"]
            self.tokens_per_step = state["tokens_per_step"]

    def tick(self, first: bool) -> None:
        now = time.perf_counter()
        if first:
            self.first_call = now - self.t0
        elif self.last is not None:
            self.times.append(now - self.last)
        self.last = now

    def pause(self) -> None:
        self.last = None

    def rate(self) -> float | None:
        return self.tokens_per_step / self.times[-1] if self.times else None


def summarize(
    history: list[dict], timer: StepTimer, flops_per_token: float | None, peak_flops: float | None
) -> dict[str, Any]:
    tokens_per_step = timer.tokens_per_step
    last = history[-1]
    vals = [r["val/loss"] for r in history if "val/loss" in r]
    step_s = float(np.median(timer.times)) if timer.times else None
    tps = tokens_per_step / step_s if step_s else None
    mfu = tps * flops_per_token / peak_flops if (tps and flops_per_token and peak_flops) else None
    return {
        "step": last["step"],
        "train_loss": last["train/loss"],
        "val_loss": vals[-1] if vals else None,
        "best_val_loss": min(vals) if vals else None,
        "tokens_seen": last["step"] * tokens_per_step,
        "tokens_trained": sum(r["train/tokens"] for r in history),
        "tokens_per_sec": tps,
        "step_seconds": step_s,
        "first_step_seconds": timer.first_call,
        "mfu": mfu,
    }
