"""three_digit: arithmetic's sums and differences with a number of 100-999, in three columns.

    Work out 243 plus 581: 3 plus 1 is 4, 4 plus 8 is 12, 2 plus 5 plus 1 is 8, so 824.
    Work out 503 minus 7: 13 minus 7 is 6, 10 minus 1 minus 0 is 9, 5 minus 1 minus 0 is 4, so 496.

The working is arithmetic's (`stagelm.tasks.arithmetic`) with a hundreds column: each
column adds or subtracts one digit of each number, with the carry or borrow of the
column before; a column that must borrow from the next writes its top digit plus 10.
At least one number has three digits, so no problem is also an arithmetic one (whose
working has two columns). It is not in the default set (`data.families`): the
default model does not learn it, and learning it beside arithmetic costs arithmetic
(docs/tasks.md has the measurements); it is for a larger model or an
imported checkpoint. The checker reads the number that ends the first sentence, as
arithmetic's.

The problem space holds about 1.5 million problems, so it is never listed: `SPACE`
decodes a problem from its index and the split samples the held-out indices
(`split_sampled`).
"""

import bisect
import random

from stagelm.tasks.arithmetic import OPS, check, credit_of, sheet_of, worked_task
from stagelm.tasks.family import Family, IndexedSpace, Problem, Task, split_sampled

# plus: every (a, b) of 0-999 but the 100 × 100 where both are under 100; minus: a of 100-999, b of 0-a.
_PLUS = 1000 * 1000 - 100 * 100
_MINUS_START = [0]  # index of the first (a, "minus", 0) among the minus problems, a = 100 + k
for _a in range(100, 1000):
    _MINUS_START.append(_MINUS_START[-1] + _a + 1)


def _decode(i: int) -> Problem:
    if i < _PLUS:
        if i < 100 * 900:  # a under 100: b is 100-999
            return (i // 900, "plus", 100 + i % 900)
        i -= 100 * 900
        return (100 + i // 1000, "plus", i % 1000)
    i -= _PLUS
    k = bisect.bisect_right(_MINUS_START, i) - 1
    return (100 + k, "minus", i - _MINUS_START[k])


SPACE = IndexedSpace(_PLUS + _MINUS_START[-1], _decode)


def working(a: int, op: str, b: int) -> str:
    """Column by column, ones first: `3 plus 1 is 4, 4 plus 8 is 12, 2 plus 5 plus 1 is 8, so 824.`"""
    da, db = [a // 10**k % 10 for k in range(3)], [b // 10**k % 10 for k in range(3)]
    steps, carry = [], 0  # carry: +1 carried (plus) or 1 borrowed (minus) into this column
    for x, y in zip(da, db, strict=True):
        if op == "plus":
            total = x + y + carry
            steps.append(f"{x} plus {y}{' plus 1' if carry else ''} is {total}")
            carry = total // 10
        else:
            borrow = int(x - carry < y)
            top = x + 10 * borrow
            steps.append(f"{top}{' minus 1' if carry else ''} minus {y} is {top - carry - y}")
            carry = borrow
    return f"{', '.join(steps)}, so {OPS[op](a, b)}."


def three_digit_task(a: int, op: str, b: int) -> Task:
    return worked_task("three_digit", a, op, b, working(a, op, b))


def ask(rng: random.Random, problem: Problem) -> Task:
    return three_digit_task(*problem)


FAMILY = Family(
    "three_digit",
    lambda: SPACE,
    ask,
    check,
    sft_share=0.3,
    corpus=sheet_of(three_digit_task),
    corpus_share=0.15,
    spec_schema={"answer": int},
    split=split_sampled,
    step_credit=credit_of(working),
)
