"""One recipe probe's figures, read from a finished project copy's runs/ (benchmarks/recipe_probe.sh).

    python benchmarks/recipe_figures.py NAME SECONDS SPEC     # from the project copy's root

Prints one JSON line: stage times, pretraining's tokens/s and val loss, and the two figures the
default run gates on (pretrain's completion-format arithmetic, SFT's chat arithmetic); null
where a stage did not finish.
"""

import argparse
import json
from datetime import datetime
from pathlib import Path


def load(path: str) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).is_file() else {}


def seconds(path: str) -> float | None:
    p = load(path)
    return (datetime.fromisoformat(p["finished"]) - datetime.fromisoformat(p["started"])).total_seconds() if p else None


def arithmetic(metrics: dict, fmt: str) -> float | None:
    return metrics.get(fmt, {}).get("arithmetic", {}).get("accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name")
    parser.add_argument("seconds", type=int, help="the run's wall time")
    parser.add_argument("spec", help="its -S settings")
    args = parser.parse_args()
    train, pre, sft = (load(f"runs/{p}/metrics.json") for p in ("pretrain", "eval/pretrain", "eval/sft"))
    figures = {
        "name": args.name,
        "spec": args.spec,
        "seconds": args.seconds,
        "pretrain_seconds": seconds("runs/pretrain/provenance.json"),
        "sft_seconds": seconds("runs/sft/provenance.json"),
        "pretrain_tokens_per_sec": train.get("tokens_per_sec"),
        "pretrain_val_loss": pre.get("val_loss"),
        "pretrain_completion": arithmetic(pre, "completion"),
        "sft_chat": arithmetic(sft, "chat"),
        "sft_val_loss": sft.get("val_loss"),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
