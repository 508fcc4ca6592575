"""arithmetic: addition and subtraction of numbers 0-99 (subtraction never goes below zero).

The answer works column by column, as a child is taught, and then states the result:

    Work out 23 plus 58: 3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 81.
    Work out 71 minus 38: 11 minus 8 is 3, 7 minus 1 minus 3 is 3, so 33.

(the ones column, then the tens with the carry or the borrow, then the result). Each
step is a one-digit fact and the result is read off the two steps, where the plain
`23 plus 58 is 81.` asks the model to find the carry without writing it (Lee et al.
2023, "Teaching Arithmetic to Small Transformers", on scratchpad formats; docs/tasks.md
has what each format reached here). Completion format: `Work out 23 plus 58:` → ` 3 plus 8 is 11, …, so 81.`;
chat: user `What is 23 plus 58?` → the same working. The checker reads the number
that ends the first sentence, so a bare `81.` passes too. The corpus carries sheets of
these lines (and the stories of `stagelm.data.synthetic` tell plain sums from the same
training pool).
"""

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from stagelm.tasks.family import Family, Problem, Task, first_sentence

OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b}


def problems() -> list[Problem]:
    adds = [(a, "plus", b) for a in range(100) for b in range(100)]
    subs = [(a, "minus", b) for a in range(100) for b in range(a + 1)]
    return adds + subs


def working(a: int, op: str, b: int) -> str:
    """The column-by-column answer: `3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 81.`"""
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    if op == "plus":
        carry = (a0 + b0) // 10
        ones = f"{a0} plus {b0} is {a0 + b0}"
        tens = f"{a1} plus {b1}{' plus 1' if carry else ''} is {a1 + b1 + carry}"
    else:
        borrow = int(a0 < b0)
        ones = f"{a0 + 10 * borrow} minus {b0} is {a0 + 10 * borrow - b0}"
        tens = f"{a1}{' minus 1' if borrow else ''} minus {b1} is {a1 - borrow - b1}"
    return f"{ones}, {tens}, so {OPS[op](a, b)}."


def worked_task(family: str, a: int, op: str, b: int, steps: str) -> Task:
    """`a op b` asked in both formats, answered by its working `steps` (this family's or three_digit's)."""
    return Task(
        family=family,
        prompt=f"Work out {a} {op} {b}:",
        chat_prompt=f"What is {a} {op} {b}?",
        answer=f" {steps}",
        chat_answer=steps,
        spec={"answer": OPS[op](a, b)},
    )


def arithmetic_task(a: int, op: str, b: int) -> Task:
    return worked_task("arithmetic", a, op, b, working(a, op, b))


def ask(rng: random.Random, problem: Problem) -> Task:
    return arithmetic_task(*problem)


_NUMBER_AT_END = re.compile(r"(?:^|\s)(-?\d+)\.$")


def check(spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    match = _NUMBER_AT_END.search(first_sentence(completion))
    return match is not None, match is not None and int(match.group(1)) == spec["answer"]


_OPERANDS = re.compile(r"(\d+) (plus|minus) (\d+)")
_LAST_NUMBER = re.compile(r"(-?\d+)$")


def carries(clause: str) -> bool:
    """Whether a column's clause takes a carry or a borrow: `2 plus 5 plus 1 is 8`, `7 minus 1 minus 3 is 3`."""
    return clause.count(" plus ") + clause.count(" minus ") >= 2


def column_credit(expected: str, completion: str) -> float:
    """The share of the column steps of worked answer `expected` that the completion's first
    sentence gets right, clause by clause: each column's result, and each later column's carry
    or borrow (`carries`)."""
    want = expected.rstrip(".").split(", ")[:-1]  # the columns; the last clause is "so N"
    got = first_sentence(completion).rstrip(".").split(", ")
    right = total = 0
    for i, clause in enumerate(want):
        mine = got[i] if i < len(got) else ""
        result, seen = _LAST_NUMBER.search(clause), _LAST_NUMBER.search(mine)
        right += bool(seen) and seen.group(1) == result.group(1)
        total += 1
        if i > 0:  # the column's carry (plus) or borrow (minus) from the one before: a third term
            right += carries(clause) == carries(mine)
            total += 1
    return right / total


def credit_of(work: Callable[[int, str, int], str]) -> Callable[[dict[str, Any], str, str], float]:
    """A worked family's partial credit: 1 for a right answer; for a wrong one, half the share of
    right column steps (`column_credit`) against the working of the prompt's own numbers."""

    def credit(spec: dict[str, Any], prompt: str, completion: str) -> float:
        if check(spec, completion)[1]:
            return 1.0
        found = _OPERANDS.search(prompt)
        if found is None:  # a prompt of a task file, worded otherwise: only the outcome is graded
            return 0.0
        a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
        return 0.5 * column_credit(work(a, op, b), completion)

    return credit


def sheet_of(task: Callable[..., Task]) -> Callable[[random.Random, Sequence[Problem]], str]:
    """The corpus documents of a worked family: 4-10 `task`s of the training pool, one per line."""

    def sheet(rng: random.Random, pool: Sequence[Problem]) -> str:
        lines = [task(*rng.choice(pool)) for _ in range(rng.randint(4, 10))]
        return "\n".join(t.prompt + t.answer for t in lines)

    return sheet


sheet = sheet_of(arithmetic_task)


FAMILY = Family(
    "arithmetic",
    problems,
    ask,
    check,
    sft_share=0.7,
    corpus=sheet,
    corpus_share=0.40,
    spec_schema={"answer": int},
    step_credit=credit_of(working),
)
