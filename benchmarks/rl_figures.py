"""The figures of a run of benchmarks/rl_on_chip.sh, read from the project copy's runs/.

    python benchmarks/rl_figures.py SECONDS [--note TEXT]     # from the project copy's root
    python benchmarks/rl_figures.py 0 --write-params OUT [--from PARAMS] key=value ...   # the script's params

Prints one JSON: the device, every stage's time (provenance started → finished), the grpo
stage's rollout and update throughput (its own metrics: completion tokens sampled per second,
the update's tokens/s and MFU against the device's published peak), and what eval@grpo
measured; null where a stage did not finish.
"""

import argparse
import json
from datetime import datetime
from pathlib import Path

import yaml

STAGES = ("pretrain", "sft", "grpo", "eval/grpo")


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def seconds(provenance: dict) -> float | None:
    if not provenance:
        return None
    return (
        datetime.fromisoformat(provenance["finished"]) - datetime.fromisoformat(provenance["started"])
    ).total_seconds()


def write_params(source: Path, out: Path, settings: list[str]) -> None:
    """`source` with each dotted key=value set, written to `out` (they may be the same file)."""
    params = yaml.safe_load(source.read_text())
    for setting in settings:
        key, value = setting.split("=", 1)
        *path, last = key.split(".")
        node = params
        for part in path:
            node = node[part]
        node[last] = yaml.safe_load(value)
    out.write_text(yaml.safe_dump(params, sort_keys=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("seconds", type=int, help="the run's wall time")
    parser.add_argument("--note", default="")
    parser.add_argument("--write-params", type=Path, help="write params.yaml (--from) with the settings, and stop")
    parser.add_argument("--from", dest="source", type=Path, default=Path("params.yaml"))
    parser.add_argument("settings", nargs="*", help="key=value, a dotted key and a YAML value")
    args = parser.parse_intermixed_args()
    if args.write_params:
        write_params(args.source, args.write_params, args.settings)
        return
    runs = Path("runs")
    provenance = {s: load(runs / s / "provenance.json") for s in STAGES}
    grpo, pretrain, evals = (
        load(runs / "grpo/metrics.json"),
        load(runs / "pretrain/metrics.json"),
        load(runs / "eval/grpo/metrics.json"),
    )
    keys = ("rollout_tokens_per_sec", "update_tokens_per_sec", "update_mfu", "first_step_seconds", "samples", "step")
    figures = {
        "note": args.note,
        "seconds": args.seconds,
        "devices": provenance["grpo"].get("devices") or provenance["pretrain"].get("devices"),
        "stage_seconds": {s: seconds(p) for s, p in provenance.items()},
        "trainable_params": provenance["grpo"].get("trainable_params"),
        "pretrain": {k: pretrain.get(k) for k in ("tokens_per_sec", "mfu", "val_loss", "first_step_seconds")},
        "grpo": {k: grpo.get(k) for k in keys},
        "eval_grpo": {k: evals.get(k) for k in ("accuracy", "val_loss")},
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
