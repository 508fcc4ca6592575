"""What a model's greedy arithmetic errors are, from eval's predictions.jsonl of the workspace or of
named experiments (issue 56: the few errors GRPO must fix on seeds 1 and 2).

    python benchmarks/arithmetic_errors.py                       # the workspace: sft and grpo
    python benchmarks/arithmetic_errors.py u3full-dyn-s1 h1one-s1 --models sft grpo --show

A subtraction's worked answer starts with its ones digits, "14 minus 3 is …" when it borrows and
"4 minus 3 is …" when it does not; an error is a *spurious borrow* (borrowed where the task's own
working, `stagelm.tasks.arithmetic.working`, does not), a *missed borrow* (did not where it does),
another subtraction error (a digit worked or copied wrong), or an addition's. Each experiment is
read at its own commit (`git for-each-ref refs/exps`), through `dvc.api.open`.
"""

import argparse
import json
import re
import subprocess
from collections import Counter

import dvc.api

from stagelm.tasks.arithmetic import working
from stagelm.tasks.family import first_sentence

QUESTION = re.compile(r"(\d+) (plus|minus) (\d+)")
KINDS = ("spurious borrow", "missed borrow", "other subtraction", "addition")


def experiment_commit(name: str) -> str:
    """The commit of the experiment `name`; refused in one line when no experiment or several have it."""
    refs = subprocess.run(
        ["git", "for-each-ref", "refs/exps", "--format=%(refname) %(objectname)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = [commit for ref, commit in zip(refs[::2], refs[1::2], strict=True) if ref.rsplit("/", 1)[1] == name]
    if len(found) != 1:
        raise SystemExit(f"{name}: {len(found)} experiments have this name (see dvc exp list --all-commits)")
    return found[0]


def kind(prompt: str, completion: str) -> str:
    """The error's kind: spurious borrow, missed borrow, other subtraction or addition."""
    a, op, b = QUESTION.findall(prompt)[-1]
    if op == "plus":
        return "addition"
    needs = borrows(working(int(a), op, int(b)))
    borrowed = borrows(first_sentence(completion).strip())
    if borrowed is None or borrowed == needs:
        return "other subtraction"
    return "spurious borrow" if borrowed else "missed borrow"


def borrows(answer: str) -> bool | None:
    """Whether a worked subtraction borrows in its ones column (`14 minus 3 is …`); None if it does not
    start with a column."""
    ones = re.match(r"(\d+) minus \d+ is", answer)
    return None if ones is None else int(ones.group(1)) >= 10


def errors(rev: str | None, model: str) -> list[dict]:
    path = f"runs/eval/{model}/predictions.jsonl"
    with dvc.api.open(path, rev=rev) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r["family"] == "arithmetic" and r["format"] == "chat" and not r["correct"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="experiment names (none: the workspace)")
    parser.add_argument("--models", nargs="+", default=["sft", "grpo"])
    parser.add_argument("--show", action="store_true", help="print each wrong answer too")
    args = parser.parse_args()
    runs = [(name, experiment_commit(name)) for name in args.names] or [("workspace", None)]
    print("| run | model | greedy errors | spurious borrow | missed borrow | other subtraction | addition |")
    print("|---|---|---|---|---|---|---|")
    shown = []
    for name, rev in runs:
        for model in args.models:
            wrong = errors(rev, model)
            kinds = Counter(kind(r["prompt"], r["completion"]) for r in wrong)
            counts = " | ".join(str(kinds[k]) for k in KINDS)
            print(f"| {name} | {model} | {len(wrong)} | {counts} |")
            shown += [(name, model, r) for r in wrong]
    if args.show:
        for name, model, r in shown:
            question = QUESTION.findall(r["prompt"])[-1]
            print(f"{name} {model}: {' '.join(question)} -> {r['completion'].strip()[:80]}")


if __name__ == "__main__":
    main()
