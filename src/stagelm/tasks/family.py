"""What a task family is: a problem space, how a problem is asked, how an answer is checked.

A `Family` is one module's whole contract with the rest of the lab (see
`stagelm.tasks`): the synthetic source draws problems from `problems()`, asks them
with `ask` in both formats (completion and chat, each with a reference answer),
mixes `corpus` documents into the pretraining text and `sft_share` of the SFT and RL
training tasks; evaluation and GRPO grade answers with `check`.
"""

import bisect
import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

Problem = tuple  # a family's problem key, e.g. (23, "plus", 58) or ("Mia", "lamp", 8)


@dataclasses.dataclass(frozen=True)
class Task:
    family: str
    prompt: str  # completion format; the answer continues it
    chat_prompt: str  # the user turn of the chat format
    answer: str  # a reference continuation of `prompt`
    chat_answer: str  # a reference assistant turn
    spec: dict[str, Any]  # what the family's checker needs


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    problems: Callable[[], Sequence[Problem]]  # the whole problem space, in a fixed order
    ask: Callable[[random.Random, Problem], Task]  # draws from the stream only for a reference answer
    check: Callable[[dict[str, Any], str], tuple[bool, bool]]  # (well_formed, correct) of a completion
    # Taught families (sft_share > 0) are drawn from the main stream, in registry order, and
    # make up that share (over the sum of the chosen taught families' shares, `data.families`)
    # of the SFT and RL training tasks. A family with sft_share 0 is
    # asked only in the rl and eval sets, from a stream of its own, so adding one changes
    # nothing else the synthetic source writes.
    sft_share: float = 0.0
    corpus: Callable[[random.Random, list[Problem]], str] | None = None  # a document from the training pool
    corpus_share: float = 0.0  # of the corpus documents
    # The keys `check` reads from a task's spec and their JSON types: task files
    # (data.rl_files, data.eval_files) are validated against it row by row.
    spec_schema: dict[str, type] = dataclasses.field(default_factory=dict)
    # (held out, training pool) of `problems()`, at least `n_held_out` held out when the space
    # allows. None: a seeded shuffle of the problems, the first n_held_out held out. A family
    # whose skill is copying from the prompt holds out whole words instead, so its eval
    # prompts ask for words no training answer of the family contains.
    split: Callable[[list[Problem], int, random.Random], tuple[list[Problem], list[Problem]]] | None = None
    # Partial credit in [0, 1] of a completion of a task (spec, chat or completion prompt), for
    # GRPO's `reward: steps`: 1 only for a right answer, a share for each right step of a wrong
    # one. None: the family's answers have no steps to check.
    step_credit: Callable[[dict[str, Any], str, str], float] | None = None
    # False: the family's tasks come from task files only (`data.*_files`), so it cannot be
    # one of `data.families`, which the synthetic source draws.
    generated: bool = True
    # True: an answer is one line (the checker reads the first sentence), so generation stops
    # at a newline; False: answers run over lines (a worked solution) to an end of turn.
    one_line: bool = True


def split_problems(problems: list[Problem], n_held_out: int, rng: random.Random) -> tuple[list, list]:
    """(held out, training pool): a seeded shuffle, the first `n_held_out` held out."""
    order = list(problems)
    rng.shuffle(order)
    return order[:n_held_out], order[n_held_out:]


class IndexedSpace(Sequence):
    """A problem space too large to list: `size` problems, the i-th decoded by `decode(i)`."""

    def __init__(self, size: int, decode: Callable[[int], Problem]):
        self.size, self.decode = size, decode

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.decode(i)


class Without(Sequence):
    """`problems` less the ones at the (sorted, distinct) indices `removed`, in order, never listed."""

    def __init__(self, problems: Sequence[Problem], removed: list[int]):
        self.problems = problems
        # the i-th kept problem sits at i + (how many removed indices lie before it): removed[k] - k
        # counts the kept problems before removed[k], a non-decreasing sequence to search.
        self.kept_before = [r - k for k, r in enumerate(removed)]

    def __len__(self) -> int:
        return len(self.problems) - len(self.kept_before)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.problems[i + bisect.bisect_right(self.kept_before, i)]


def split_sampled(problems: Sequence[Problem], n_held_out: int, rng: random.Random) -> tuple[list, Sequence]:
    """(held out, training pool) of a large space: `n_held_out` problems drawn without
    replacement (a tenth of the space at most), the pool every other problem, unlisted."""
    count = min(n_held_out, len(problems) // 10)
    chosen = rng.sample(range(len(problems)), count)
    return [problems[i] for i in chosen], Without(problems, sorted(chosen))


def split_by_value(
    problems: list[Problem], n_held_out: int, rng: random.Random, field: int, min_share: float
) -> tuple[list, list]:
    """(held out, training pool) where no value of problem[field] is in both: a seeded choice of
    at least `min_share` of the values (more when `n_held_out` problems need them), the held-out
    problems drawn from theirs; the pool is every problem of the other values."""
    values = sorted({p[field] for p in problems})
    rng.shuffle(values)
    per_value = len(problems) / len(values)
    count = min(len(values) - 1, max(math.ceil(min_share * len(values)), math.ceil(n_held_out / per_value)))
    held_values = set(values[:count])
    held = [p for p in problems if p[field] in held_values]
    rng.shuffle(held)
    return held[:n_held_out], [p for p in problems if p[field] not in held_values]


def first_sentence(completion: str) -> str:
    """The part of a completion that is graded: up to the first period, on the first line."""
    line = completion.strip().split("\n", 1)[0]
    end = line.find(".")
    return line[: end + 1].strip() if end >= 0 else line.strip()
