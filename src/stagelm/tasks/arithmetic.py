"""arithmetic: addition and subtraction of numbers 0-99 (subtraction never goes below zero).

Completion format, as the corpus writes it: `23 plus 58 is` → ` 81.`; chat format:
user `What is 23 plus 58?` → assistant `23 plus 58 is 81.` The checker reads the
number that ends the first sentence. The corpus carries sheets of these lines (and
the stories of `stagelm.synthetic` tell sums from the same training pool).
"""

import random
import re
from typing import Any

from stagelm.tasks.family import Family, Problem, Task, first_sentence

OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b}


def problems() -> list[Problem]:
    adds = [(a, "plus", b) for a in range(100) for b in range(100)]
    subs = [(a, "minus", b) for a in range(100) for b in range(a + 1)]
    return adds + subs


def arithmetic_task(a: int, op: str, b: int) -> Task:
    c = OPS[op](a, b)
    return Task(
        family="arithmetic",
        prompt=f"{a} {op} {b} is",
        chat_prompt=f"What is {a} {op} {b}?",
        answer=f" {c}.",
        chat_answer=f"{a} {op} {b} is {c}.",
        spec={"answer": c},
    )


def ask(rng: random.Random, problem: Problem) -> Task:
    return arithmetic_task(*problem)


_NUMBER_AT_END = re.compile(r"(?:^|\s)(-?\d+)\.$")


def check(spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    match = _NUMBER_AT_END.search(first_sentence(completion))
    return match is not None, match is not None and int(match.group(1)) == spec["answer"]


def sheet(rng: random.Random, pool: list[Problem]) -> str:
    """A corpus document: 4-10 facts of the training pool, one per line."""
    lines = [arithmetic_task(*rng.choice(pool)) for _ in range(rng.randint(4, 10))]
    return "\n".join(t.prompt + t.answer for t in lines)


FAMILY = Family(
    "arithmetic", problems, ask, check, sft_share=0.7, corpus=sheet, corpus_share=0.40, spec_schema={"answer": int}
)
