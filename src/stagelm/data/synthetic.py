"""The synthetic source: a corpus and task sets generated from `data.seed`.

Everything comes from `random.Random(seed)` (a family asked only in the rl and eval
sets from a stream of its own, `random.Random(f"{seed}:{family}")`), whose stream
CPython keeps stable across platforms and versions, so the output is byte-identical
on every machine.

The corpus mixes templated short stories (characters, places, objects, dialogue,
small sums told in words) with each taught family's corpus documents (sheets of
worked sums in the completion format and sheets of constrained sentences), in the
shares `stagelm.tasks` registers. Before anything is drawn, each family's problem
space is split (`Family.split`; by default a seeded shuffle whose first `num_eval`
problems are held out): held-out problems are asked only in the eval set and never
appear in the corpus, the SFT set or the RL set.
"""

import random
from collections.abc import Callable

from stagelm.tasks import REGISTRY, Family, Task
from stagelm.tasks.family import Problem, split_problems
from stagelm.tasks.words import (
    ADJECTIVES,
    ANIMALS,
    COLORS,
    COUNT_NOUNS,
    FEELINGS,
    NAMES,
    OBJECTS,
    PLACES,
    TIMES,
    WEATHER,
)

STORY_SHARE = 0.45  # of the corpus documents; the taught families' documents share the rest


# --- stories ------------------------------------------------------------------------


def story(rng: random.Random, facts: list[Problem]) -> str:
    """A short templated story; sums in it come from the training pool `facts`."""
    a, b = rng.sample(NAMES, 2)
    obj, obj2 = rng.sample(OBJECTS, 2)
    place, place2 = rng.sample(PLACES, 2)
    w = dict(
        a=a,
        b=b,
        obj=obj,
        obj2=obj2,
        place=place,
        place2=place2,
        animal=rng.choice(ANIMALS),
        adj=rng.choice(ADJECTIVES),
        color=rng.choice(COLORS),
        feel=rng.choice(FEELINGS),
        weather=rng.choice(WEATHER),
        time=rng.choice(TIMES),
    )
    openings = [
        "Once upon a time, {a} lived in a {adj} house near the {place}.",
        "One {time}, {a} went to the {place} with a {color} {obj}.",
        "{a} was a {adj} {animal} who lived by the {place}.",
        "It was a {weather} {time} when {a} walked to the {place}.",
    ]
    middles = [
        "{a} found a {color} {obj} under an old {obj2}.",
        "At the {place2}, {a} met {b}.",
        '"Hello, {b}!" said {a}. "Do you want to play?"',
        '"Can you help me find my {obj}?" asked {b}.',
        "They looked for the {obj} in the {place2}, but it was not there.",
        "{a} felt {feel} because the {obj} was so {adj}.",
        "A {animal} ran past them and hid behind the {obj2}.",
        '"Look!" said {b}. "The {obj} is {color}!"',
        "The {weather} wind moved the {obj2} across the {place2}.",
        "{b} laughed, and {a} laughed too.",
    ]
    endings = [
        "In the end, {a} and {b} were {feel}.",
        "From that day on, {a} kept the {obj} close.",
        "{a} smiled and went home to the {place}.",
        "That night, {a} dreamed of the {color} {obj}.",
    ]
    sentences = [rng.choice(openings)] + rng.sample(middles, rng.randint(2, 5))
    if rng.random() < 0.5:
        x, op, y = rng.choice(facts)
        noun = rng.choice(COUNT_NOUNS)
        verb = "found" if op == "plus" else "gave away"
        sentences.append(f"{{a}} had {x} {noun} and {verb} {y}. {x} {op} {y} is {x + y if op == 'plus' else x - y}.")
    sentences.append(rng.choice(endings))
    return " ".join(s.format(**w) for s in sentences)


# --- the whole source ---------------------------------------------------------------


def generate(
    seed: int, num_documents: int, num_sft: int, num_rl: int, num_eval: int, families: dict[str, Family] = REGISTRY
) -> dict[str, list]:
    """Corpus documents and task sets: {"corpus": [str], "sft": [messages], "rl": [Task], "eval": [Task]}."""
    rng = random.Random(seed)
    taught = [f for f in families.values() if f.sft_share > 0]
    held, pools = {}, {}
    for family in taught:
        split = family.split or split_problems
        held[family.name], pools[family.name] = split(family.problems(), num_eval, rng)

    facts = pools.get("arithmetic", [])  # the stories tell sums of the arithmetic training pool
    kinds: list[tuple[float, Callable[[], str]]] = [(STORY_SHARE if facts else 0.0, lambda: story(rng, facts))]
    for f in taught:
        if f.corpus is not None and f.corpus_share > 0:
            kinds.append((f.corpus_share, lambda f=f: f.corpus(rng, pools[f.name])))
    weights = [w for w, _ in kinds]
    corpus = (
        [rng.choices([k for _, k in kinds], weights=weights)[0]() for _ in range(num_documents)] if any(weights) else []
    )

    total_share = sum(f.sft_share for f in taught)

    def training_task() -> Task:
        draw, bound = rng.random(), 0.0
        for family in taught:
            bound += family.sft_share / total_share
            if draw < bound or family is taught[-1]:
                return family.ask(rng, rng.choice(pools[family.name]))
        raise AssertionError("unreachable: the last taught family takes the rest")

    sft_tasks = [training_task() for _ in range(num_sft)] if taught else []
    sft = [
        {
            "family": t.family,
            "messages": [{"role": "user", "content": t.chat_prompt}, {"role": "assistant", "content": t.chat_answer}],
        }
        for t in sft_tasks
    ]
    rl = [training_task() for _ in range(num_rl)] if taught else []
    evals = [f.ask(rng, p) for f in taught for p in held[f.name]]

    # A family asked only in the rl and eval sets draws from its own stream, so the
    # corpus, the SFT set and the other families' prompts do not depend on it.
    for family in families.values():
        if family.sft_share > 0:
            continue
        own = random.Random(f"{seed}:{family.name}")
        held_out, pool = (family.split or split_problems)(family.problems(), num_eval, own)
        rl += [family.ask(own, p) for p in pool]
        evals += [family.ask(own, p) for p in held_out]
    return {"corpus": corpus, "sft": sft, "rl": rl, "eval": evals}
