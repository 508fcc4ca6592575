"""add_three: the sum of three numbers 0-99, worked column by column.

    Work out 23 plus 58 plus 41: 3 plus 8 plus 1 is 12, 2 plus 5 plus 4 plus 1 is 12, so 122.

The ones column adds three digits (a thousand facts, where two-number arithmetic
has a hundred) and carries up to 2 into the tens column, which adds up to four
terms. It is the default set's family with headroom: the default model learns the
format and most columns, so its greedy answers are often wrong while some of its
samples are right, which is the room reinforcement learning works in (the README
has what each stage reaches). Completion format: `Work out 23 plus 58 plus 41:`;
chat: user `What is 23 plus 58 plus 41?`; the checker reads the number that ends
the first sentence, as arithmetic's does.

The problem space holds a million problems, so it is never built as a list: `SPACE`
decodes a problem from its index and the split samples the held-out indices
(`split_sampled`).
"""

import random

from stagelm.tasks.arithmetic import check
from stagelm.tasks.family import Family, IndexedSpace, Problem, Task, split_sampled

SPACE = IndexedSpace(100**3, lambda i: (i // 10_000, i // 100 % 100, i % 100))


def working(a: int, b: int, c: int) -> str:
    """`3 plus 8 plus 1 is 12, 2 plus 5 plus 4 plus 1 is 12, so 122.`"""
    (a1, a0), (b1, b0), (c1, c0) = divmod(a, 10), divmod(b, 10), divmod(c, 10)
    carry = (a0 + b0 + c0) // 10
    ones = f"{a0} plus {b0} plus {c0} is {a0 + b0 + c0}"
    tens = f"{a1} plus {b1} plus {c1}{f' plus {carry}' if carry else ''} is {a1 + b1 + c1 + carry}"
    return f"{ones}, {tens}, so {a + b + c}."


def add_three_task(a: int, b: int, c: int) -> Task:
    steps = working(a, b, c)
    return Task(
        family="add_three",
        prompt=f"Work out {a} plus {b} plus {c}:",
        chat_prompt=f"What is {a} plus {b} plus {c}?",
        answer=f" {steps}",
        chat_answer=steps,
        spec={"answer": a + b + c},
    )


def ask(rng: random.Random, problem: Problem) -> Task:
    return add_three_task(*problem)


def sheet(rng: random.Random, pool) -> str:
    """A corpus document: 4-10 worked problems of the training pool, one per line."""
    lines = [add_three_task(*rng.choice(pool)) for _ in range(rng.randint(4, 10))]
    return "\n".join(t.prompt + t.answer for t in lines)


FAMILY = Family(
    "add_three",
    lambda: SPACE,
    ask,
    check,
    sft_share=0.3,
    corpus=sheet,
    corpus_share=0.15,
    spec_schema={"answer": int},
    split=split_sampled,
)
