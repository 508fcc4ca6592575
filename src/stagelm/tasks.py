"""Task families: how each task is asked and how a program checks the answer.

Three families, fixed so later stages never need to change the data stage:

- `arithmetic`: addition and subtraction of numbers 0-99 (subtraction never goes
  below zero). Completion format, as the corpus writes it: `23 plus 58 is` → ` 81.`;
  chat format: user `What is 23 plus 58?` → assistant `23 plus 58 is 81.`
- `uses_word`: a constraint-following family. Completion format:
  `A sentence about Mia with the word "lamp" in at most 8 words:` → ` Mia found a lamp.`;
  the chat user turn asks the same. The checker accepts any sentence that contains
  the word and has at most that many words, so answers vary and a program verifies them.
- `word_limit`: a length instruction, checked the way IFEval checks its instructions
  (only the instruction, not the topic). Chat: `Write a sentence about Mia at the
  park. Use at most 4 words.` → `Mia ran to the park.` fails, `Mia ran home.`
  passes; the answer must be a sentence of words, capitalised and without digits
  (`9 plus 40.` and `cake to Lucy.` fail).
  Completion format: `A sentence about Mia at the park in at most 4 words:`.
  Only the rl and eval sets ask it: no corpus document and no SFT conversation does,
  so it measures what RL with a checkable reward adds to instructions SFT never showed.

An answer is the completion's first sentence (up to and including the first period).
"""

import dataclasses
import re
from typing import Any

from stagelm.config import FAMILIES

OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b}


@dataclasses.dataclass(frozen=True)
class Task:
    family: str
    prompt: str  # completion format; the answer continues it
    chat_prompt: str  # the user turn of the chat format
    answer: str  # a reference continuation of `prompt`
    chat_answer: str  # a reference assistant turn
    spec: dict[str, Any]  # what the family's checker needs


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


def uses_word_task(name: str, word: str, max_words: int, sentence: str) -> Task:
    return Task(
        family="uses_word",
        prompt=f'A sentence about {name} with the word "{word}" in at most {max_words} words:',
        chat_prompt=f'Write a sentence about {name} that uses the word "{word}" in at most {max_words} words.',
        answer=f" {sentence}",
        chat_answer=sentence,
        spec={"word": word, "max_words": max_words},
    )


def word_limit_task(name: str, place: str, max_words: int, sentence: str) -> Task:
    return Task(
        family="word_limit",
        prompt=f"A sentence about {name} at the {place} in at most {max_words} words:",
        chat_prompt=f"Write a sentence about {name} at the {place}. Use at most {max_words} words.",
        answer=f" {sentence}",
        chat_answer=sentence,
        spec={"max_words": max_words},
    )


def first_sentence(completion: str) -> str:
    """The part of a completion that is graded: up to the first period, on the first line."""
    line = completion.strip().split("\n", 1)[0]
    end = line.find(".")
    return line[: end + 1].strip() if end >= 0 else line.strip()


_NUMBER_AT_END = re.compile(r"(?:^|\s)(-?\d+)\.$")


def check_answer(family: str, spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    """(well_formed, correct) for a completion of a task of `family`."""
    sentence = first_sentence(completion)
    if family == "arithmetic":
        match = _NUMBER_AT_END.search(sentence)
        return match is not None, match is not None and int(match.group(1)) == spec["answer"]
    if family == "uses_word":
        words = sentence.split()
        well_formed = sentence.endswith(".") and len(words) >= 2
        bare = {w.strip('.,!?;:"').lower() for w in words}
        correct = well_formed and spec["word"].lower() in bare and len(words) <= spec["max_words"]
        return well_formed, correct
    if family == "word_limit":
        words = sentence.split()
        # A sentence of words: capitalised, no digits ("9 plus 40." and "cake to Lucy." are not).
        wordlike = all(w.strip('.,!?;:"').isalpha() for w in words)
        capitalised = words[0].strip('"').istitle() if words else False
        well_formed = sentence.endswith(".") and len(words) >= 2 and wordlike and capitalised
        return well_formed, well_formed and len(words) <= spec["max_words"]
    raise ValueError(f"unknown task family {family!r}; expected one of {FAMILIES}")
