"""Benchmarks of the machine a stage runs on: train step, decoding, loader, memory.

Every measurement runs its function `warmup` times, then times `repetitions` calls,
each ending in `jax.block_until_ready`, so a sample is the wall time of finished work.
Summaries are min / median / max (p99 only from 20 samples up); raw samples are kept.
Models use random weights and random tokens of the `benchmark` section's shape, so
the figures depend on the code, the params and the machine, never on a trained model.
"""

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.data.loader import PackedRows, batch_iterator
from stagelm.infer.generate import Generator
from stagelm.model.decoder import Decoder, DecoderConfig, flops_per_token
from stagelm.pipeline.config import BenchmarkConfig, TrainingConfig
from stagelm.train.step import init_state, make_optimizer, make_train_step

SCHEMA_VERSION = 1


def timed(fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn` (which must block until its work is done), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def summary(values: list[float]) -> dict[str, float]:
    out = {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
    if len(values) >= 20:
        out["p99"] = float(np.percentile(values, 99))
    return out


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


def bench_train(cfg: DecoderConfig, seq_len: int, batch: int, warmup: int, reps: int) -> dict[str, Any]:
    """Train-step samples (seconds) and the first call's time (compile + one step)."""
    model = Decoder(cfg, nnx.Rngs(0))
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(bench_optimizer(warmup + reps + 1), params)
    state = init_state(params, tx, jax.random.key(0))
    step = make_train_step(graphdef, tx)
    rows = jax.device_put({k: v[None] for k, v in random_rows(cfg.vocab_size, batch, seq_len).items()})
    holder = {"state": state}

    def one() -> None:
        holder["state"], metrics = step(holder["state"], frozen, rows)
        jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    return {"first_call_seconds": first, "step_seconds": timed(one, warmup, reps)}


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


def bench_loader(rows: PackedRows, batch: int, warmup: int, reps: int, batches_per_rep: int = 20) -> list[float]:
    """Seconds per `batches_per_rep` batches drawn from the Grain loader (shuffled, as training reads it)."""
    it = batch_iterator(rows, batch, 0)
    return timed(lambda: [next(it) for _ in range(batches_per_rep)], warmup, reps)


def memory() -> dict[str, Any]:
    """Peak host RSS of this process, and the first device's memory stats when the backend has them."""
    out: dict[str, Any] = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    stats = jax.devices()[0].memory_stats()
    if stats:
        out["device"] = {k: v for k, v in stats.items() if isinstance(v, int | float)}
    return out


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "cpu": cpu_model(),
        "threads": os.cpu_count(),
        "python": platform.python_version(),
    }


def mfu(tokens_per_sec: float, cfg: DecoderConfig, seq_len: int, peak: float | None) -> float | None:
    return tokens_per_sec * flops_per_token(cfg, seq_len) / peak if peak else None


def decoder_config(section: BenchmarkConfig) -> DecoderConfig:
    """The benchmark section's decoder: its shape, vocabulary and compute dtype; float32 weights."""
    return DecoderConfig(vocab_size=section.vocab_size, **section.shape(), dtype=section.dtype, param_dtype="float32")
