"""report stage: one Markdown page with every model's metrics, curves, samples and lineage.

python stages/report.py --runs runs --models pretrain,sft --out runs/report.md --figures runs/report \
    --benchmark runs/benchmark/metrics.json
"""

from pathlib import Path

from stagelm.infra.errors import StagelmError, run_main
from stagelm.infra.files import atomic_write_bytes, read_json
from stagelm.measure.report import render
from stagelm.pipeline.stage import start


def main() -> None:
    options = {
        "models": {"required": True, "help": "comma-separated model stages, in pipeline order"},
        "benchmark": {"type": Path, "help": "the benchmark stage's metrics.json"},
    }
    args = start(__doc__, "runs", "out", "figures", options=options).args
    models = [m for m in args.models.split(",") if m]
    for name in models:
        if not (args.runs / "eval" / name / "metrics.json").is_file():
            raise StagelmError(f"{args.runs / 'eval' / name / 'metrics.json'}: missing; run `dvc repro eval@{name}`")
    benchmark = None
    if args.benchmark is not None:
        if not args.benchmark.is_file():
            raise StagelmError(f"{args.benchmark}: missing; run `dvc repro benchmark`")
        benchmark = read_json(args.benchmark)
    atomic_write_bytes(args.out, render(args.runs, models, args.figures, args.out, benchmark).encode())
    print(f"report: {args.out} ({len(models)} models)")


if __name__ == "__main__":
    run_main(main)
