"""The synthetic source: a corpus and task sets generated from `data.seed`.

Everything comes from `random.Random(seed)` (the word_limit family from a second
stream of the same seed), whose stream CPython keeps stable across platforms and
versions, so the output is byte-identical on every machine.

The corpus mixes templated short stories (characters, places, objects, dialogue,
small sums told in words), arithmetic sheets in the completion format of
`stagelm.tasks` (`23 plus 58 is 81.`) and sheets of constrained sentences. Before
anything is drawn, each family's problem space is split: the first `num_eval`
problems of a seeded shuffle are held out for eval and never appear in the corpus,
the SFT set or the RL set.
"""

import random
from collections.abc import Callable

from stagelm.tasks import Task, arithmetic_task, uses_word_task, word_limit_task

# fmt: off
NAMES = [
    "Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Lily", "Max", "Ella", "Ben", "Nora", "Jack",
    "Ruby", "Finn", "Ivy", "Owen", "Lucy", "Noah", "Rosa", "Eli", "Anna", "Hugo", "Jade", "Omar",
]
PLACES = [
    "garden", "forest", "kitchen", "park", "river", "school", "market", "beach", "farm", "library",
    "hill", "village", "castle", "cave", "lake", "bakery",
]
OBJECTS = [
    "ball", "lamp", "book", "kite", "hat", "cup", "key", "box", "shoe", "coin", "map", "bell",
    "drum", "boat", "cake", "apple", "leaf", "stone", "rope", "brush", "spoon", "clock", "flag",
    "shell", "ring", "basket", "candle", "pencil", "blanket", "button", "feather", "mirror",
    "ladder", "bucket", "whistle", "pillow", "jar", "sock", "scarf", "umbrella", "wagon", "violin",
    "puzzle", "balloon", "bottle", "carrot", "cookie", "lantern", "ticket", "window", "teapot",
    "rocket", "robot", "painting", "letter", "crown", "compass", "tent", "sandwich", "marble",
]
ANIMALS = ["cat", "dog", "fox", "owl", "rabbit", "duck", "frog", "bear", "mouse", "horse", "goat", "turtle"]
ADJECTIVES = ["big", "small", "old", "new", "shiny", "quiet", "funny", "brave", "tiny", "soft", "strange", "happy"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink", "brown"]
FEELINGS = ["happy", "sad", "proud", "tired", "excited", "scared", "calm", "surprised"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "snowy"]
TIMES = ["morning", "evening", "afternoon", "night", "day"]
COUNT_NOUNS = ["apples", "stones", "shells", "coins", "cookies", "marbles", "leaves", "buttons"]
# fmt: on

Problem = tuple  # a family's problem key, e.g. (23, "plus", 58) or ("Mia", "lamp", 8)


def arithmetic_problems() -> list[Problem]:
    adds = [(a, "plus", b) for a in range(100) for b in range(100)]
    subs = [(a, "minus", b) for a in range(100) for b in range(a + 1)]
    return adds + subs


def uses_word_problems() -> list[Problem]:
    return [(n, w, k) for n in NAMES for w in OBJECTS for k in range(5, 13)]


def word_limit_problems() -> list[Problem]:
    return [(n, p, k) for n in NAMES for p in PLACES for k in range(3, 9)]


def split_problems(problems: list[Problem], n_held_out: int, rng: random.Random) -> tuple[list, list]:
    """(held out, training pool): a seeded shuffle, the first `n_held_out` held out."""
    order = list(problems)
    rng.shuffle(order)
    return order[:n_held_out], order[n_held_out:]


# --- sentences ----------------------------------------------------------------------

_USES_WORD_TEMPLATES = [
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
    fitting = [t for t in _USES_WORD_TEMPLATES if len(t.split()) <= max_words]
    template = rng.choice(fitting)
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


_WORD_LIMIT_TEMPLATES = [
    "{name} smiled.",
    "{name} was {feel}.",
    "{name} ran to the {place}.",
    "{name} liked the {adj} {place}.",
    "{name} played at the {place} today.",
    "{name} saw a {animal} at the {place}.",
    "{name} walked to the {place} one {time}.",
]


def limited_sentence(rng: random.Random, name: str, place: str, max_words: int) -> str:
    """A reference answer: a sentence about `name` at `place` in at most `max_words` words."""
    template = rng.choice([t for t in _WORD_LIMIT_TEMPLATES if len(t.split()) <= max_words])
    return template.format(
        name=name,
        place=place,
        feel=rng.choice(FEELINGS),
        adj=rng.choice(ADJECTIVES),
        animal=rng.choice(ANIMALS),
        time=rng.choice(TIMES),
    )


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


def arithmetic_sheet(rng: random.Random, facts: list[Problem]) -> str:
    lines = [arithmetic_task(*rng.choice(facts)) for _ in range(rng.randint(4, 10))]
    return "\n".join(t.prompt + t.answer for t in lines)


def uses_word_sheet(rng: random.Random, problems: list[Problem]) -> str:
    lines = [uses_word_from(rng, rng.choice(problems)) for _ in range(rng.randint(3, 6))]
    return "\n".join(t.prompt + t.answer for t in lines)


def uses_word_from(rng: random.Random, problem: Problem) -> Task:
    name, word, k = problem
    return uses_word_task(name, word, k, constrained_sentence(rng, name, word, k))


# --- the whole source ---------------------------------------------------------------


def generate(seed: int, num_documents: int, num_sft: int, num_rl: int, num_eval: int) -> dict[str, list]:
    """Corpus documents and task sets: {"corpus": [str], "sft": [messages], "rl": [Task], "eval": [Task]}."""
    rng = random.Random(seed)
    held_arith, arith = split_problems(arithmetic_problems(), num_eval, rng)
    held_words, words = split_problems(uses_word_problems(), num_eval, rng)

    kinds: list[tuple[float, Callable[[], str]]] = [
        (0.45, lambda: story(rng, arith)),
        (0.40, lambda: arithmetic_sheet(rng, arith)),
        (0.15, lambda: uses_word_sheet(rng, words)),
    ]
    corpus = [rng.choices([k for _, k in kinds], weights=[w for w, _ in kinds])[0]() for _ in range(num_documents)]

    def training_task() -> Task:
        if rng.random() < 0.7:
            return arithmetic_task(*rng.choice(arith))
        return uses_word_from(rng, rng.choice(words))

    sft_tasks = [training_task() for _ in range(num_sft)]
    sft = [
        {
            "family": t.family,
            "messages": [{"role": "user", "content": t.chat_prompt}, {"role": "assistant", "content": t.chat_answer}],
        }
        for t in sft_tasks
    ]
    rl = [training_task() for _ in range(num_rl)]
    evals = [arithmetic_task(*p) for p in held_arith] + [uses_word_from(rng, p) for p in held_words]

    # word_limit is asked only in the rl and eval sets, from its own stream, so the
    # corpus, the SFT set and the other families' prompts do not depend on it.
    limit_rng = random.Random(f"{seed}:word_limit")
    held_limits, limits = split_problems(word_limit_problems(), num_eval, limit_rng)
    rl += [word_limit_task(*p, limited_sentence(limit_rng, *p)) for p in limits]
    evals += [word_limit_task(*p, limited_sentence(limit_rng, *p)) for p in held_limits]
    return {"corpus": corpus, "sft": sft, "rl": rl, "eval": evals}
