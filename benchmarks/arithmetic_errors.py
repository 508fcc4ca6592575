"""What a model's greedy arithmetic errors are, from eval's predictions.jsonl of the workspace or of
named experiments (issue 56: the few errors GRPO must fix on seeds 1 and 2).

    python benchmarks/arithmetic_errors.py                       # the workspace: sft and grpo
    python benchmarks/arithmetic_errors.py u3full-dyn-s1 h1one-s1 --models sft grpo --show

A subtraction's worked answer starts with its ones digits, "14 minus 3 is …" when it borrows and
"4 minus 3 is …" when it does not; an error is a *spurious borrow* (borrowed where the top ones digit
is at least the bottom one), a *missed borrow* (did not where it is smaller), another subtraction
error (a digit worked or copied wrong), or an addition's. Each
experiment is read at its own commit (`git for-each-ref refs/exps`), through `dvc.api.open`.
"""

import argparse
import json
import re
import subprocess
from collections import Counter

import dvc.api

QUESTION = re.compile(r"(\d+) (plus|minus) (\d+)")
FIRST = re.compile(r"\s*(\d+) (?:plus|minus) (\d+) is")
KINDS = ("spurious borrow", "missed borrow", "other subtraction", "addition")


def experiment_commits() -> dict[str, str]:
    refs = subprocess.run(
        ["git", "for-each-ref", "refs/exps", "--format=%(refname) %(objectname)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return {ref.rsplit("/", 1)[1].split()[0]: ref.split()[1] for ref in refs if ref.strip()}


def kind(prompt: str, completion: str) -> str:
    """The error's kind: spurious borrow, missed borrow, other subtraction or addition."""
    question, first = QUESTION.findall(prompt), FIRST.match(completion)
    if question and question[-1][1] == "plus":
        return "addition"
    if not question or not first:
        return "other subtraction"
    top, _, bottom = question[-1]
    needs = int(top) % 10 < int(bottom) % 10
    borrowed = int(first.group(1)) >= 10
    if borrowed and not needs:
        return "spurious borrow"
    if needs and not borrowed:
        return "missed borrow"
    return "other subtraction"


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
    commits = experiment_commits()
    runs = [(name, commits[name]) for name in args.names] or [("workspace", None)]
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
