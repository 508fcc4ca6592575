"""uses_word: a sentence about a name that uses a given word, within a word budget.

Completion format: `A sentence about Mia with the word lamp in at most 8 words:` →
` Mia found a lamp.`; the chat user turn asks the same. The checker accepts any
sentence that names the person, contains the word and has at most that many words,
so answers vary and a program verifies them. The word stands bare in the prompt (not
in quotes), so the token the answer needs is one the prompt holds: the skill is
copying it.

The split holds out whole words (`split_by_value`): the eval prompts ask for words that
no corpus sheet, SFT answer or RL prompt of this family contains, so a model passes
only by copying the word from the prompt, not by recalling a trained answer. The
stories use every word, so each is a known token.
"""

import functools
import random
from typing import Any

from stagelm.tasks.family import Family, Problem, Task, first_sentence, split_by_value
from stagelm.tasks.words import ADJECTIVES, COLORS, NAMES, OBJECTS, PLACES, TIMES


def problems() -> list[Problem]:
    return [(n, w, k) for n in NAMES for w in OBJECTS for k in range(5, 13)]


def uses_word_task(name: str, word: str, max_words: int, sentence: str) -> Task:
    return Task(
        family="uses_word",
        prompt=f"A sentence about {name} with the word {word} in at most {max_words} words:",
        chat_prompt=f"Write a sentence about {name} that uses the word {word} in at most {max_words} words.",
        answer=f" {sentence}",
        chat_answer=sentence,
        spec={"name": name, "word": word, "max_words": max_words},
    )


_TEMPLATES = [
    "{name} found a {word}.",
    "{name} gave the {word} to {other}.",
    "The {word} was {adj}, said {name}.",
    "{name} put a {word} near the {place}.",
    "{name} likes the {color} {word} very much.",
    "{name} saw a {adj} {word} in the {place}.",
    "One {time}, {name} lost the {color} {word} at the {place}.",
]


def constrained_sentence(rng: random.Random, name: str, word: str, max_words: int) -> str:
    """A sentence about `name` that uses `word` in at most `max_words` words."""
    template = rng.choice([t for t in _TEMPLATES if len(t.split()) <= max_words])
    other = rng.choice([n for n in NAMES if n != name])
    return template.format(
        name=name,
        word=word,
        other=other,
        adj=rng.choice(ADJECTIVES),
        color=rng.choice(COLORS),
        place=rng.choice(PLACES),
        time=rng.choice(TIMES),
    )


def ask(rng: random.Random, problem: Problem) -> Task:
    name, word, k = problem
    return uses_word_task(name, word, k, constrained_sentence(rng, name, word, k))


def bare_words(sentence: str) -> list[str]:
    return [w.strip('.,!?;:"').lower() for w in sentence.split()]


def check(spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    sentence = first_sentence(completion)
    words = bare_words(sentence)
    well_formed = sentence.endswith(".") and len(words) >= 2
    named = spec["name"].lower() in words and spec["word"].lower() in words
    return well_formed, well_formed and named and len(words) <= spec["max_words"]


def sheet(rng: random.Random, pool: list[Problem]) -> str:
    """A corpus document: 3-6 asked-and-answered problems of the training pool."""
    lines = [ask(rng, rng.choice(pool)) for _ in range(rng.randint(3, 6))]
    return "\n".join(t.prompt + t.answer for t in lines)


FAMILY = Family(
    "uses_word",
    problems,
    ask,
    check,
    sft_share=0.3,
    corpus=sheet,
    corpus_share=0.15,
    spec_schema={"name": str, "word": str, "max_words": int},
    split=functools.partial(split_by_value, field=1, min_share=0.2),  # a fifth of the words, at least
)
