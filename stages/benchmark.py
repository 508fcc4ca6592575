"""benchmark stage: train-step, decode, loader and memory figures of this machine.

    python stages/benchmark.py --params params.yaml --packed data/packed/train --out runs/benchmark

Times the `benchmark` section's decoder (random weights and tokens) after warm-up,
`benchmark.repetitions` times each (naive full-prefix decoding, the slow reference the
KV cache is measured against, `benchmark.naive_repetitions` times), and writes medians
under stable keys to `<out>/metrics.json`, every raw sample to `<out>/samples.jsonl`,
and provenance.
MFU is measured against a large jitted matmul timed in the same run and, on a
device with a published peak (hardware.PEAK_FLOPS), against that peak too. When torch
is importable, the same shape in plain PyTorch (stagelm.measure.torch_peer) is timed in the
same run and the ratios are recorded under `torch`; without it that part is skipped.
"""

import importlib.util
import json

import jax

from stagelm.data.loader import PackedRows
from stagelm.infra.devices import peak_flops
from stagelm.infra.errors import run_main
from stagelm.infra.files import atomic_write_bytes, write_json
from stagelm.infra.memory import require_memory
from stagelm.measure.benchmark import (
    SCHEMA_VERSION,
    bench_decode,
    bench_loader,
    bench_train,
    decoder_config,
    environment,
    matmul_flops,
    memory,
    mfu,
    summary,
)
from stagelm.model.footprint import benchmark_bytes
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.provenance import git_state
from stagelm.pipeline.stage import start


def main() -> None:
    stage = start(__doc__, "packed", "out")  # --packed: a packed split, for the loader figure
    args = stage.args
    cfg = load_section(stage.params, "benchmark")
    rows = PackedRows(args.packed)
    model = decoder_config(cfg)
    warm, reps = cfg.warmup, cfg.repetitions
    samples: dict[str, list[float]] = {}
    for key, need in benchmark_bytes(cfg).items():  # every size checked before anything is allocated
        require_memory(need, key, f"the benchmark's {key.split('.')[1]} measure")

    samples["matmul.flops_per_sec"] = matmul_flops(cfg.matmul_size, cfg.dtype, warm, reps)
    train = bench_train(model, cfg.seq_len, cfg.batch_size, warm, reps)
    samples["train.step_seconds"] = train["step_seconds"]
    tokens_per_step = cfg.seq_len * cfg.batch_size
    samples["train.tokens_per_sec"] = [tokens_per_step / s for s in train["step_seconds"]]
    for batch in (1, 8):
        decode = bench_decode(model, batch, cfg.prompt_len, cfg.new_tokens, warm, reps, cfg.naive_repetitions)
        for kind in ("cached", "naive"):
            samples[f"decode.{kind}_b{batch}.tokens_per_sec"] = [
                batch * cfg.new_tokens / s for s in decode[f"{kind}_seconds"]
            ]
        samples[f"decode.cached_b{batch}.prefill_seconds"] = decode["prefill_seconds"]
    loader_batches = 20
    loader = bench_loader(rows, cfg.batch_size, warm, reps, loader_batches)
    row_tokens = rows.manifest["row_len"] - 1
    samples["loader.batches_per_sec"] = [loader_batches / s for s in loader]
    samples["loader.tokens_per_sec"] = [loader_batches * cfg.batch_size * row_tokens / s for s in loader]

    peer = None
    if importlib.util.find_spec("torch") is not None:  # the PyTorch peer, side by side, when installed
        from stagelm.measure.torch_peer import run_peer

        peer = run_peer(cfg, warm, reps)
        samples["torch.train.tokens_per_sec"] = [tokens_per_step / s for s in peer["train_step_seconds"]]
        for b in (1, 8):
            samples[f"torch.decode.cached_b{b}.tokens_per_sec"] = [
                b * cfg.new_tokens / s for s in peer[f"cached_b{b}_seconds"]
            ]

    stats = {name: summary(values) for name, values in samples.items()}
    med = {name: s["median"] for name, s in stats.items()}
    train_tps, peak = med["train.tokens_per_sec"], med["matmul.flops_per_sec"]
    metrics = {
        "schema_version": SCHEMA_VERSION,
        "train": {
            "tokens_per_sec": train_tps,
            "step_seconds": med["train.step_seconds"],
            "first_call_seconds": train["first_call_seconds"],
            "mfu": mfu(train_tps, model, cfg.seq_len, peak),
            "mfu_vs_device_peak": mfu(train_tps, model, cfg.seq_len, peak_flops(cfg.dtype)),
        },
        "matmul": {"flops_per_sec": peak, "size": cfg.matmul_size},
        "decode": {
            f"{kind}_b{b}": {"tokens_per_sec": med[f"decode.{kind}_b{b}.tokens_per_sec"]}
            for kind in ("cached", "naive")
            for b in (1, 8)
        },
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
    if peer is not None:
        torch_train = med["torch.train.tokens_per_sec"]
        metrics["torch"] = {
            "train": {"tokens_per_sec": torch_train},
            "decode": {
                f"cached_b{b}": {"tokens_per_sec": med[f"torch.decode.cached_b{b}.tokens_per_sec"]} for b in (1, 8)
            },
            "ratio": {
                "train": train_tps / torch_train,
                **{
                    f"decode_b{b}": med[f"decode.cached_b{b}.tokens_per_sec"]
                    / med[f"torch.decode.cached_b{b}.tokens_per_sec"]
                    for b in (1, 8)
                },
            },
        }
    for b in (1, 8):
        metrics["decode"][f"cached_b{b}"]["prefill_seconds"] = med[f"decode.cached_b{b}.prefill_seconds"]
        metrics["decode"][f"speedup_b{b}"] = (
            med[f"decode.cached_b{b}.tokens_per_sec"] / med[f"decode.naive_b{b}.tokens_per_sec"]
        )
    if jax.process_index() == 0:
        lines = [
            json.dumps({"measure": k, "rep": i, "value": v}) for k, vs in samples.items() for i, v in enumerate(vs)
        ]
        atomic_write_bytes(args.out / "samples.jsonl", ("\n".join(lines) + "\n").encode())
        write_json(args.out / "metrics.json", metrics)
        read, inputs = {"benchmark": section_dict(cfg)}, {"packed": args.packed / "manifest.json"}
        stage.record(args.out / "provenance.json", read, inputs, {"environment": metrics["environment"]})
    d = metrics["decode"]
    print(
        f"benchmark: train {train_tps:,.0f} tok/s (first call {train['first_call_seconds']:.1f} s, "
        f"MFU {metrics['train']['mfu']:.0%} of a {peak / 1e9:,.0f} GFLOP/s matmul); decode cached b1 "
        f"{d['cached_b1']['tokens_per_sec']:,.0f} / b8 {d['cached_b8']['tokens_per_sec']:,.0f} tok/s "
        f"({d['speedup_b1']:.1f}× / {d['speedup_b8']:.1f}× naive); loader {med['loader.tokens_per_sec']:,.0f} tok/s"
    )
    if peer is None:
        print("benchmark: torch is not installed; the PyTorch peer was skipped")
    else:
        r = metrics["torch"]["ratio"]
        print(
            f"benchmark: against PyTorch {r['train']:.2f}× train, {r['decode_b1']:.2f}× / {r['decode_b8']:.2f}× decode"
        )


if __name__ == "__main__":
    run_main(main)
