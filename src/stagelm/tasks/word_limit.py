"""word_limit: a sentence about a person at a place, within a word limit.

The checker verifies the whole instruction: the word limit (as IFEval checks its
length instructions), and that the sentence is about the person and the place asked
(both appear in it). Chat: `Write a sentence about Mia at the park. Use at most 4
words.` → `Mia ran to the park.` fails (5 words), `Mia liked the park.` passes, `Mia
ran home.` fails (no park); the answer must be a sentence of words, capitalised and
without digits (`9 plus 40.` and `cake to Lucy.` fail). So no one constant sentence
passes more than the few prompts about its own person and place. Completion format:
`A sentence about Mia at the park in at most 4 words:`. Only the rl and eval sets ask it (sft_share 0): no
corpus document and no SFT conversation does, so it measures what RL with a
checkable reward adds to instructions SFT never showed.
"""

import random
from typing import Any

from stagelm.tasks.family import Family, Problem, Task, first_sentence
from stagelm.tasks.words import ADJECTIVES, ANIMALS, NAMES, PLACES, TIMES


def problems() -> list[Problem]:
    return [(n, p, k) for n in NAMES for p in PLACES for k in range(4, 10)]


def word_limit_task(name: str, place: str, max_words: int, sentence: str) -> Task:
    return Task(
        family="word_limit",
        prompt=f"A sentence about {name} at the {place} in at most {max_words} words:",
        chat_prompt=f"Write a sentence about {name} at the {place}. Use at most {max_words} words.",
        answer=f" {sentence}",
        chat_answer=sentence,
        spec={"name": name, "place": place, "max_words": max_words},
    )


_TEMPLATES = [
    "{name} liked the {place}.",
    "{name} left the {place}.",
    "{name} ran to the {place}.",
    "{name} liked the {adj} {place}.",
    "{name} played at the {place} today.",
    "{name} saw a {animal} at the {place}.",
    "{name} walked to the {place} one {time}.",
]


def limited_sentence(rng: random.Random, name: str, place: str, max_words: int) -> str:
    """A reference answer: a sentence about `name` at `place` in at most `max_words` words."""
    template = rng.choice([t for t in _TEMPLATES if len(t.split()) <= max_words])
    return template.format(
        name=name,
        place=place,
        adj=rng.choice(ADJECTIVES),
        animal=rng.choice(ANIMALS),
        time=rng.choice(TIMES),
    )


def ask(rng: random.Random, problem: Problem) -> Task:
    return word_limit_task(*problem, limited_sentence(rng, *problem))


def check(spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    sentence = first_sentence(completion)
    words = sentence.split()
    # A sentence of words: capitalised, no digits ("9 plus 40." and "cake to Lucy." are not).
    wordlike = all(w.strip('.,!?;:"').isalpha() for w in words)
    capitalised = words[0].strip('"').istitle() if words else False
    well_formed = sentence.endswith(".") and len(words) >= 2 and wordlike and capitalised
    bare = {w.strip('.,!?;:"').lower() for w in words}
    about = spec["name"].lower() in bare and spec["place"].lower() in bare
    return well_formed, well_formed and about and len(words) <= spec["max_words"]


FAMILY = Family("word_limit", problems, ask, check, spec_schema={"name": str, "place": str, "max_words": int})
