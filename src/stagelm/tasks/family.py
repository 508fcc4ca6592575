"""What a task family is: a problem space, how a problem is asked, how an answer is checked.

A `Family` is one module's whole contract with the rest of the lab (see
`stagelm.tasks`): the synthetic source draws problems from `problems()`, asks them
with `ask` in both formats (completion and chat, each with a reference answer),
mixes `corpus` documents into the pretraining text and `sft_share` of the SFT and RL
training tasks; evaluation and GRPO grade answers with `check`.
"""

import dataclasses
import random
from collections.abc import Callable
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
    problems: Callable[[], list[Problem]]  # the whole problem space, in a fixed order
    ask: Callable[[random.Random, Problem], Task]  # draws from the stream only for a reference answer
    check: Callable[[dict[str, Any], str], tuple[bool, bool]]  # (well_formed, correct) of a completion
    # Taught families (sft_share > 0) are drawn from the main stream, in registry order, and
    # make up that share of the SFT and RL training tasks. A family with sft_share 0 is
    # asked only in the rl and eval sets, from a stream of its own, so adding one changes
    # nothing else the synthetic source writes.
    sft_share: float = 0.0
    corpus: Callable[[random.Random, list[Problem]], str] | None = None  # a document from the training pool
    corpus_share: float = 0.0  # of the corpus documents
    # The keys `check` reads from a task's spec and their JSON types: task files
    # (data.rl_files, data.eval_files) are validated against it row by row.
    spec_schema: dict[str, type] = dataclasses.field(default_factory=dict)


def first_sentence(completion: str) -> str:
    """The part of a completion that is graded: up to the first period, on the first line."""
    line = completion.strip().split("\n", 1)[0]
    end = line.find(".")
    return line[: end + 1].strip() if end >= 0 else line.strip()
