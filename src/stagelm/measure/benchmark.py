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
from functools import partial
from pathlib import Path
from typing import Any

import jax

from stagelm.data.loader import PackedRows, batch_iterator
from stagelm.infra.devices import peak_flops
from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.measure.microbench import bench_decode, bench_train, matmul_flops
from stagelm.measure.timing import summary, timed
from stagelm.model.decoder import DecoderConfig, flops_per_token
from stagelm.model.footprint import benchmark_bytes
from stagelm.pipeline.config import BenchmarkConfig
from stagelm.pipeline.provenance import git_state
from stagelm.train.loop import require_step_memory

SCHEMA_VERSION = 2  # 2: train.mfu against the published peak only; train.matmul_fraction


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
        require_memory(need, key, f"the benchmark's {MEASURES[key]}")


# What each key of `footprint.benchmark_bytes` sizes, as its refusal says it.
MEASURES = {
    "benchmark.matmul_size": "matmul",
    "benchmark.vocab_size": "model state (parameters, gradients, Adam's moments; mostly the embedding)",
    "benchmark.n_layers": "model state (parameters, gradients, Adam's moments)",
    "benchmark.batch_size": "train step (batch_size × seq_len tokens)",
    "benchmark.seq_len": "train step (batch_size × seq_len tokens)",
    "benchmark.prompt_len": "decoding (prompt_len + new_tokens positions)",
    "benchmark.new_tokens": "decoding (prompt_len + new_tokens positions)",
}


def measure_all(cfg: BenchmarkConfig, rows: PackedRows) -> tuple[dict[str, list[float]], float]:
    """(raw samples of every measure under its stable key, the train step's first call in seconds):
    the matmul, the train step, cached and naive decoding at batch 1 and 8, the loader, and the
    PyTorch peer's train step and decoding when `benchmark.torch_peer` asks for them."""
    if cfg.torch_peer and importlib.util.find_spec("torch") is None:  # before minutes of measuring
        raise StagelmError("benchmark.torch_peer: torch is not installed; pip install torch, or set it false")
    model, warm, reps = decoder_config(cfg), cfg.warmup, cfg.repetitions
    tokens_per_step = cfg.seq_len * cfg.batch_size
    samples = {"matmul.flops_per_sec": matmul_flops(cfg.matmul_size, cfg.dtype, warm, reps)}
    check = partial(require_step_memory, key="benchmark.batch_size (or benchmark.seq_len)")
    train = bench_train(model, cfg.seq_len, cfg.batch_size, warm, reps, check=check)
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
    if cfg.torch_peer:  # the PyTorch peer, side by side, when asked for
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
    MFU against the device's published peak and the fraction of the in-run matmul, the PyTorch
    ratios when the peer ran, and the summaries, memory and environment beside them."""
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
            # MFU only against the device's published peak (None where stagelm.infra.devices knows
            # none, as on a CPU); beside it the fraction of the matmul timed in this run, which a
            # model's own matmuls can pass (a small fp32 matmul on a TPU: "MFU 111%" before).
            "mfu": mfu(train_tps, model, cfg.seq_len, peak_flops(cfg.dtype)),
            "matmul_fraction": mfu(train_tps, model, cfg.seq_len, peak),
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
    matmul = f"{t['matmul_fraction']:.0%} of a {metrics['matmul']['flops_per_sec'] / 1e9:,.0f} GFLOP/s matmul"
    mfu = "no published peak" if t["mfu"] is None else f"MFU {t['mfu']:.1%} of the device's published peak"
    lines = [
        f"benchmark: train {t['tokens_per_sec']:,.0f} tok/s (first call {t['first_call_seconds']:.1f} s, "
        f"{mfu}; {matmul}); decode cached b1 "
        f"{d['cached_b1']['tokens_per_sec']:,.0f} / b8 {d['cached_b8']['tokens_per_sec']:,.0f} tok/s "
        f"({d['speedup_b1']:.1f}× / {d['speedup_b8']:.1f}× naive); "
        f"loader {metrics['loader']['tokens_per_sec']:,.0f} tok/s"
    ]
    if "torch" not in metrics:
        return lines  # benchmark.torch_peer: false
    r = metrics["torch"]["ratio"]
    return [
        *lines,
        f"benchmark: against PyTorch {r['train']:.2f}× train, {r['decode_b1']:.2f}× / {r['decode_b8']:.2f}× decode",
    ]
