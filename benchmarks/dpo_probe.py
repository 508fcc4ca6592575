"""One DPO recipe on a finished project's SFT model, then its eval: the quick probe behind docs/dpo.md's table.

    python benchmarks/dpo_probe.py PROJECT NAME [key=value ...]

PROJECT is a folder where `dvc repro sft` ran (runs/sft/model, data/raw, data/packed/val):
a fresh clone after `make repro`, for one. The stage and the eval run as the pipeline runs
them, with this tree's code and params.yaml changed by the key=value pairs, into PROJECT's
runs/dpo-probe/NAME (no stage of DVC's writes there). One JSON line: the eval's greedy
errors beside SFT's, the share removed, val loss, pass@k, the pairs drawn and the stage's
seconds. A probe, not a DVC experiment: the pretrain and SFT stages it starts from are not
rerun.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("project", type=Path, help="a folder where `dvc repro sft` ran")
    parser.add_argument("name", help="the probe's name (its folder under PROJECT's runs/dpo-probe)")
    parser.add_argument("settings", nargs="*", help="key=value changes to params.yaml, as `dvc exp run -S` takes")
    args = parser.parse_args()
    project, name, overrides = args.project.resolve(), args.name, args.settings
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        section = params
        for part in path:
            section = section[part]
        section[last] = yaml.safe_load(value)
    out = project / "runs/dpo-probe" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    common = ["--params", str(out / "params.yaml"), "--val", "data/packed/val", "--raw", "data/raw"]
    t0 = time.time()
    stage = [sys.executable, str(ROOT / "stages/dpo.py"), *common, "--model", "runs/sft/model"]
    stage += ["--out", str(out / "dpo"), "--checkpoints", str(out / "ck")]
    subprocess.run(stage, cwd=project, env=env, check=True)
    seconds = time.time() - t0
    ev = [sys.executable, str(ROOT / "stages/eval.py"), *common, "--model", str(out / "dpo/model"), "--name", "dpo"]
    ev += ["--format", "chat", "--inputs", "inputs", "--out", str(out / "eval")]
    subprocess.run(ev, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL)
    sft = json.loads((project / "runs/eval/sft/metrics.json").read_text())
    got = json.loads((out / "eval/metrics.json").read_text())
    trained = json.loads((out / "dpo/metrics.json").read_text())
    errors = [round((1 - m["chat"]["accuracy"]) * m["chat"]["n"]) for m in (sft, got)]
    row = {
        "name": name,
        "set": overrides,
        "sft_errors": errors[0],
        "errors": errors[1],
        "removed": round((errors[0] - errors[1]) / errors[0], 3) if errors[0] else None,
        "val_loss": round(got["val_loss"], 4),
        "sft_val_loss": round(sft["val_loss"], 4),
        "pass_k": got["chat_pass_k"]["pass_at_" + str(got["chat_pass_k"]["k"])],
        "sft_pass_k": sft["chat_pass_k"]["pass_at_" + str(sft["chat_pass_k"]["k"])],
        "pairs": trained["pairs"],
        "reward_accuracy_last10": round(trained["reward_accuracy_last10"], 3),
        "stage_seconds": round(seconds),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
