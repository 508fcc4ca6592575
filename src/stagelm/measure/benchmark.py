"""Benchmarks of the machine a stage runs on: train step, decoding, loader, memory.

Every measurement runs its function `warmup` times, then times `repetitions` calls,
each ending in `jax.block_until_ready`, so a sample is the wall time of finished work.
Summaries are min / median / max (p99 only from 20 samples up); raw samples are kept.
Models use random weights and random tokens of the `benchmark` section's shape, so
the figures depend on the code, the params and the machine, never on a trained model.
"""

import importlib.util
import json
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.data.loader import PackedRows, batch_iterator
from stagelm.infer.generate import Generator
from stagelm.infra.devices import peak_flops
from stagelm.infra.memory import require_memory
from stagelm.measure.timing import summary, timed
from stagelm.model.decoder import Decoder, DecoderConfig, flops_per_token
from stagelm.model.footprint import benchmark_bytes
from stagelm.pipeline.config import BenchmarkConfig, TrainingConfig
from stagelm.pipeline.provenance import git_state
from stagelm.train.step import init_state, make_optimizer, make_train_step

SCHEMA_VERSION = 1


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


LOADER_BATCHES = 20  # batches drawn per timed loader call


def require_benchmark_memory(cfg: BenchmarkConfig) -> None:
    """Every size of the section checked before anything is allocated, one line naming its key."""
    for key, need in benchmark_bytes(cfg).items():
        require_memory(need, key, f"the benchmark's {key.split('.')[1]} measure")


def measure_all(cfg: BenchmarkConfig, rows: PackedRows) -> tuple[dict[str, list[float]], float]:
    """(raw samples of every measure under its stable key, the train step's first call in seconds):
    the matmul, the train step, cached and naive decoding at batch 1 and 8, the loader, and the
    PyTorch peer's train step and decoding when torch is importable."""
    model, warm, reps = decoder_config(cfg), cfg.warmup, cfg.repetitions
    tokens_per_step = cfg.seq_len * cfg.batch_size
    samples = {"matmul.flops_per_sec": matmul_flops(cfg.matmul_size, cfg.dtype, warm, reps)}
    train = bench_train(model, cfg.seq_len, cfg.batch_size, warm, reps)
    samples["train.step_seconds"] = train["step_seconds"]
    samples["train.tokens_per_sec"] = [tokens_per_step / s for s in train["step_seconds"]]
    for batch in (1, 8):
        decode = bench_decode(model, batch, cfg.prompt_len, cfg.new_tokens, warm, reps, cfg.naive_repetitions)
        for kind in ("cached", "naive"):
            samples[f"decode.{kind}_b{batch}.tokens_per_sec"] = [
                batch * cfg.new_tokens / s for s in decode[f"{kind}_seconds"]
            ]
        samples[f"decode.cached_b{batch}.prefill_seconds"] = decode["prefill_seconds"]
    loader = bench_loader(rows, cfg.batch_size, warm, reps, LOADER_BATCHES)
    row_tokens = rows.manifest["row_len"] - 1
    samples["loader.batches_per_sec"] = [LOADER_BATCHES / s for s in loader]
    samples["loader.tokens_per_sec"] = [LOADER_BATCHES * cfg.batch_size * row_tokens / s for s in loader]
    if importlib.util.find_spec("torch") is not None:  # the PyTorch peer, side by side, when installed
        from stagelm.measure.torch_peer import run_peer

        peer = run_peer(cfg, warm, reps)
        samples["torch.train.tokens_per_sec"] = [tokens_per_step / s for s in peer["train_step_seconds"]]
        for b in (1, 8):
            samples[f"torch.decode.cached_b{b}.tokens_per_sec"] = [
                b * cfg.new_tokens / s for s in peer[f"cached_b{b}_seconds"]
            ]
    return samples, train["first_call_seconds"]


def benchmark_metrics(cfg: BenchmarkConfig, samples: dict[str, list[float]], first_call: float) -> dict[str, Any]:
    """metrics.json of the benchmark stage: medians under stable keys (schema SCHEMA_VERSION),
    MFU against the matmul and the device's peak, the PyTorch ratios when the peer ran, and the
    summaries, memory and environment beside them."""
    stats = {name: summary(values) for name, values in samples.items()}
    med = {name: s["median"] for name, s in stats.items()}
    train_tps, peak, model = med["train.tokens_per_sec"], med["matmul.flops_per_sec"], decoder_config(cfg)
    decode = {
        f"{k}_b{b}": {"tokens_per_sec": med[f"decode.{k}_b{b}.tokens_per_sec"]}
        for k in ("cached", "naive")
        for b in (1, 8)
    }
    for b in (1, 8):
        decode[f"cached_b{b}"]["prefill_seconds"] = med[f"decode.cached_b{b}.prefill_seconds"]
        decode[f"speedup_b{b}"] = med[f"decode.cached_b{b}.tokens_per_sec"] / med[f"decode.naive_b{b}.tokens_per_sec"]
    metrics = {
        "schema_version": SCHEMA_VERSION,
        "train": {
            "tokens_per_sec": train_tps,
            "step_seconds": med["train.step_seconds"],
            "first_call_seconds": first_call,
            "mfu": mfu(train_tps, model, cfg.seq_len, peak),
            "mfu_vs_device_peak": mfu(train_tps, model, cfg.seq_len, peak_flops(cfg.dtype)),
        },
        "matmul": {"flops_per_sec": peak, "size": cfg.matmul_size},
        "decode": decode,
        "loader": {
            "batches_per_sec": med["loader.batches_per_sec"],
            "tokens_per_sec": med["loader.tokens_per_sec"],
            "margin_over_train": med["loader.tokens_per_sec"] / train_tps,
        },
        "memory": memory(),
        "summaries": stats,
        "environment": environment(),
        "commit": git_state().get("commit"),
    }
    if "torch.train.tokens_per_sec" in med:
        metrics["torch"] = peer_metrics(med)
    return metrics


def peer_metrics(med: dict[str, float]) -> dict[str, Any]:
    """The PyTorch peer's medians, and ours over its (above 1: stagelm is faster)."""
    torch_train = med["torch.train.tokens_per_sec"]
    decode = {
        b: med[f"decode.cached_b{b}.tokens_per_sec"] / med[f"torch.decode.cached_b{b}.tokens_per_sec"] for b in (1, 8)
    }
    return {
        "train": {"tokens_per_sec": torch_train},
        "decode": {f"cached_b{b}": {"tokens_per_sec": med[f"torch.decode.cached_b{b}.tokens_per_sec"]} for b in (1, 8)},
        "ratio": {"train": med["train.tokens_per_sec"] / torch_train, **{f"decode_b{b}": r for b, r in decode.items()}},
    }


def samples_jsonl(samples: dict[str, list[float]]) -> bytes:
    """Every raw sample as one JSON line: {"measure", "rep", "value"}."""
    lines = [json.dumps({"measure": k, "rep": i, "value": v}) for k, vs in samples.items() for i, v in enumerate(vs)]
    return ("\n".join(lines) + "\n").encode()


def benchmark_lines(metrics: dict[str, Any]) -> list[str]:
    """What the stage prints: train and decode speed, MFU, the loader, and the peer's ratios."""
    d, t = metrics["decode"], metrics["train"]
    lines = [
        f"benchmark: train {t['tokens_per_sec']:,.0f} tok/s (first call {t['first_call_seconds']:.1f} s, "
        f"MFU {t['mfu']:.0%} of a {metrics['matmul']['flops_per_sec'] / 1e9:,.0f} GFLOP/s matmul); decode cached b1 "
        f"{d['cached_b1']['tokens_per_sec']:,.0f} / b8 {d['cached_b8']['tokens_per_sec']:,.0f} tok/s "
        f"({d['speedup_b1']:.1f}× / {d['speedup_b8']:.1f}× naive); "
        f"loader {metrics['loader']['tokens_per_sec']:,.0f} tok/s"
    ]
    if "torch" not in metrics:
        return [*lines, "benchmark: torch is not installed; the PyTorch peer was skipped"]
    r = metrics["torch"]["ratio"]
    return [
        *lines,
        f"benchmark: against PyTorch {r['train']:.2f}× train, {r['decode_b1']:.2f}× / {r['decode_b8']:.2f}× decode",
    ]
