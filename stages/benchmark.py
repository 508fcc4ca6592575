"""benchmark stage: train-step, decode, loader and memory figures of this machine.

    python stages/benchmark.py --params params.yaml --packed data/packed/train --out runs/benchmark

Times the `benchmark` section's decoder (random weights and tokens) after warm-up,
`benchmark.repetitions` times each (naive full-prefix decoding, the slow reference the
KV cache is measured against, `benchmark.naive_repetitions` times), and writes medians
under stable keys to `<out>/metrics.json`, every raw sample to `<out>/samples.jsonl`,
and provenance (stagelm.measure.benchmark). MFU is measured against a large jitted matmul
timed in the same run and, on a device with a published peak, against that peak too. With
`benchmark.torch_peer: true` (torch installed), the same shape in plain PyTorch
(stagelm.measure.torch_peer) is timed in the same run and the ratios are recorded under `torch`.
"""

import jax

from stagelm.data.loader import PackedRows
from stagelm.infra.errors import run_main
from stagelm.infra.files import atomic_write_bytes, write_json
from stagelm.measure.benchmark import (
    benchmark_lines,
    benchmark_metrics,
    measure_all,
    require_benchmark_memory,
    samples_jsonl,
)
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import start


def main() -> None:
    stage = start(__doc__, "packed", "out")  # --packed: a packed split, for the loader figure
    args = stage.args
    cfg = load_section(stage.params, "benchmark")
    rows = PackedRows(args.packed)
    require_benchmark_memory(cfg)
    samples, first_call = measure_all(cfg, rows)
    metrics = benchmark_metrics(cfg, samples, first_call)
    if jax.process_index() == 0:
        atomic_write_bytes(args.out / "samples.jsonl", samples_jsonl(samples))
        write_json(args.out / "metrics.json", metrics)
        read, inputs = {"benchmark": section_dict(cfg)}, {"packed": args.packed / "manifest.json"}
        stage.record(args.out / "provenance.json", read, inputs, {"environment": metrics["environment"]})
    print("\n".join(benchmark_lines(metrics)))


if __name__ == "__main__":
    run_main(main)
