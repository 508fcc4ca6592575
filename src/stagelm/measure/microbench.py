"""The timed pieces of a benchmark: a matmul (the device's practical peak), a train step and
greedy decoding of a decoder with random weights and tokens.

The benchmark stage (`measure.benchmark`) and the dev scripts in benchmarks/ both time
these, so a figure in either means the same thing; nothing here reads data files, so
benchmarks/accelerator.py runs them on a machine with only JAX, Flax and Optax.
"""

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.infer.generate import Generator
from stagelm.measure.timing import timed
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.pipeline.config import TrainingConfig
from stagelm.train.step import init_state, make_optimizer, make_train_step


def matmul_flops(n: int, dtype: str, warmup: int, reps: int) -> list[float]:
    """FLOP/s samples of an (n, n) @ (n, n) jitted matmul: the practical peak of this device."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.dtype(dtype))
    mm = jax.jit(jnp.matmul)
    return [2 * n**3 / s for s in timed(lambda: mm(a, b).block_until_ready(), warmup, reps)]


def matmul_gflops(n: int = 2048, reps: int = 10) -> int:
    """Median GFLOP/s of an (n, n) fp32 matmul: one number that tells a fast machine from a slow one."""
    return round(float(np.median(matmul_flops(n, "float32", 2, reps))) / 1e9)


def bench_optimizer(steps: int) -> TrainingConfig:
    """AdamW at a constant lr, decay on every matrix: what a pretraining step costs."""
    return TrainingConfig(
        lr=3e-4,
        min_lr_ratio=1.0,
        schedule="constant",
        warmup_steps=0,
        decay_fraction=0.0,
        weight_decay=0.1,
        decay_embeddings=True,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        grad_clip=0.0,
        batch_size=1,
        grad_accum=1,
        steps=steps,
        eval_every=steps,
        eval_batches=1,
        log_every=steps,
        checkpoint_every=steps,
        keep_checkpoints=1,
    )


def random_rows(vocab: int, batch: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq_len + 1, dtype=np.int32), tokens.shape).copy()
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens), "positions": positions}


def bench_train(
    cfg: DecoderConfig,
    seq_len: int,
    batch: int,
    warmup: int,
    reps: int,
    accumulation: int = 1,
    check: Callable | None = None,
    trace_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Train-step samples (seconds) and the first call's time (compile + one step) for steps of
    `accumulation` micro-batches of `batch` rows. `check(step, state, frozen, rows)`, when given,
    runs before the first call (the training stages' memory check of the compiled step); with
    `trace_dir`, one more step is profiled there (`profile`: `device_time_by_op`)."""
    model = Decoder(cfg, nnx.Rngs(0))
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(bench_optimizer(warmup + reps + 1), params)
    holder = {"state": init_state(params, tx, jax.random.key(0))}
    step = make_train_step(graphdef, tx)
    micro = [random_rows(cfg.vocab_size, batch, seq_len, seed) for seed in range(accumulation)]
    rows = jax.device_put({k: np.stack([m[k] for m in micro]) for k in micro[0]})
    if check is not None:
        check(step, holder["state"], frozen, rows)

    def one() -> None:
        holder["state"], metrics = step(holder["state"], frozen, rows)
        jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    out = {"first_call_seconds": first, "step_seconds": timed(one, warmup, reps)}
    if trace_dir is not None:  # one more step under the profiler: where its device time goes
        with jax.profiler.trace(str(trace_dir)):
            one()
        out["profile"] = device_time_by_op(trace_dir)
    return out


def device_time_by_op(trace_dir: str | Path) -> dict[str, Any]:
    """The device time of a profiler trace (`jax.profiler.trace`) by XLA op (`op_breakdown`), read
    with JAX's own reader (`jax.profiler.ProfileData`). Empty where the trace has no device plane
    (the CPU's ops are not traced as a device's)."""
    from jax.profiler import ProfileData

    seconds: dict[str, float] = {}
    for path in sorted(Path(trace_dir).rglob("*.xplane.pb")):
        for plane in ProfileData.from_file(str(path)).planes:
            if plane.name.startswith("/device:"):
                for line in plane.lines:
                    if line.name == "XLA Ops":
                        for event in line.events:
                            seconds[event.name] = seconds.get(event.name, 0.0) + event.duration_ns / 1e9
    return op_breakdown(seconds) if seconds else {}


def op_breakdown(seconds: dict[str, float]) -> dict[str, Any]:
    """{op kind: share of the device time} from {XLA op (its HLO text, `%name.N = ...`): seconds}:
    each op by its name without its number (`fusion`, `convolution_convert_fusion`, a splash
    kernel's `splash_mha_fwd_segmented_residuals` ...). A `while` op's time is its body's ops'
    (listed too), so it is left out of the total. `top_ops`: the largest single op of each of the ten
    largest kinds, with the start of its HLO text (its shapes and layouts) and its share."""
    kinds: dict[str, float] = {}
    largest: dict[str, tuple[float, str]] = {}
    for text, s in seconds.items():
        kind = re.sub(r"\.\d+$", "", text.split(" = ")[0].lstrip("%"))
        if not kind.startswith("while"):
            kinds[kind] = kinds.get(kind, 0.0) + s
            largest[kind] = max(largest.get(kind, (0.0, "")), (s, text))
    total = sum(kinds.values())
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    return {
        "device_seconds": total,
        "shares": {k: round(v / total, 4) for k, v in ranked if v / total >= 0.001},
        "top_ops": [[largest[k][1][:400], round(largest[k][0] / total, 4)] for k, _ in ranked[:10]],
    }


def bench_decode(
    cfg: DecoderConfig, batch: int, prompt_len: int, new_tokens: int, warmup: int, reps: int, naive_reps: int = 0
) -> dict[str, list[float]]:
    """Seconds per greedy generation of `new_tokens` (cached; naive full-prefix `naive_reps` times) and per prefill."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, "t0"))
    gen = Generator(Decoder(cfg, nnx.Rngs(0)), tokenizer, prompt_len + new_tokens)
    prompts = np.random.default_rng(1).integers(10, cfg.vocab_size, (batch, prompt_len)).tolist()
    out = {"cached_seconds": timed(lambda: gen.generate(prompts, new_tokens, until_stop=False), warmup, reps)}
    layout = gen.layout(prompts, new_tokens)
    out["prefill_seconds"] = timed(lambda: jax.block_until_ready(gen._prefill(gen.params, *layout)), warmup, reps)
    if naive_reps:
        out["naive_seconds"] = timed(lambda: gen.naive_generate(prompts, new_tokens), 1, naive_reps)
    return out
