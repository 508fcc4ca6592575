"""Write inputs/lm_eval/: an offline lm-eval task the default model can be scored on.

    python benchmarks/lm_eval_example_task.py [--out inputs/lm_eval] [--items 200]

`arith_cloze`: the synthetic corpus's worked sums (`Work out 23 plus 58: 3 plus 8 is 11, 2
plus 5 plus 1 is 8, so`) with four endings to choose from, the right result and three near it
(off by one, two, ten or twenty; acc, acc_norm). The sums are drawn from a seed of this script's own, not from
the pipeline's held-out set: it shows the mechanism and the figures' meaning, the held-out
accuracy of `eval@M` stays the measure of the arithmetic itself (docs/evaluating.md).
"""

import argparse
import json
import random
from pathlib import Path

from stagelm.tasks.arithmetic import OPS, working

YAML = """# An offline lm-eval task (written by benchmarks/lm_eval_example_task.py): docs/evaluating.md.
task: arith_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def items(n: int, seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        op = rng.choice(sorted(OPS))
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        a, b = (a, b) if op == "plus" or a >= b else (b, a)
        steps = working(a, op, b)
        result = OPS[op](a, b)
        head = steps[: steps.rindex(" so ") + len(" so")]
        wrong = sorted({result + d for d in (-10, -1, 1, 10, 2, 20) if result + d >= 0})
        choices = [f"{v}." for v in [result, *rng.sample(wrong, 3)]]
        rng.shuffle(choices)
        label = choices.index(f"{result}.")
        out.append({"context": f"Work out {a} {op} {b}: {head}", "choices": choices, "label": label})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("inputs/lm_eval"))
    parser.add_argument("--items", type=int, default=200)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "arith_cloze.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in items(args.items)))
    (args.out / "arith_cloze.yaml").write_text(YAML.format(data=data.as_posix()))
    print(f"wrote {args.out}/arith_cloze.yaml and its {args.items} items")


if __name__ == "__main__":
    main()
