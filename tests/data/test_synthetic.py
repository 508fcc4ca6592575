"""The synthetic source is deterministic, structured, and keeps eval problems out of training."""

import hashlib
import json
import random

from stagelm.data import synthetic
from stagelm.tasks import REGISTRY, SYNTHETIC, Family, Task, check_answer, first_sentence, select
from stagelm.tasks.arithmetic import arithmetic_task
from stagelm.tasks.family import IndexedSpace, split_sampled
from stagelm.tasks.three_digit import three_digit_task
from stagelm.tasks.uses_word import bare_words, uses_word_task
from stagelm.tasks.word_limit import word_limit_task
from stagelm.tasks.words import NAMES, OBJECTS, PLACES


def digest(generated: dict) -> str:
    def plain(x):
        return x.__dict__ if hasattr(x, "__dict__") else x

    return hashlib.sha256(json.dumps(generated, default=plain, sort_keys=True).encode()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes():
    a = synthetic.generate(3, 200, 50, 50, 50)
    assert digest(a) == digest(synthetic.generate(3, 200, 50, 50, 50))
    assert digest(a) != digest(synthetic.generate(4, 200, 50, 50, 50))


def test_pinned_output_is_identical_on_every_machine():
    # A change here means the generator's output changed: every downstream artifact
    # changes with it. Update the pin only on purpose.
    for names, pin in PINNED.items():
        corpus = synthetic.generate(0, 50, 5, 5, 5, select(names, "data.families"))["corpus"]
        assert hashlib.sha256("\x00".join(corpus).encode()).hexdigest()[:16] == pin, names


PINNED = {
    ("arithmetic",): "ad132ec96633a738",  # the default data.families
    # The set before three_digit was registered: choosing it gives the bytes it always gave.
    ("arithmetic", "uses_word", "word_limit"): "c3d0d92595c9327e",
}


def test_a_large_problem_space_is_split_without_listing_it():
    listed = [(i // 100, i % 100) for i in range(1000)]
    space = IndexedSpace(1000, lambda i: (i // 100, i % 100))
    held, pool = split_sampled(space, 60, random.Random(5))
    assert len(held) == len(set(held)) == 60 and len(pool) == 940
    assert list(pool) == [p for p in listed if p not in set(held)]  # every other problem, in order
    assert split_sampled(space, 500, random.Random(5))[0].__len__() == 100  # a tenth held out at most
    g = synthetic.generate(0, 300, 300, 300, 200, select(["three_digit"], "data.families"))
    held_prompts = {t.prompt for t in g["eval"]}
    assert len(held_prompts) == 200
    assert {t.family for t in g["rl"]} == {m["family"] for m in g["sft"]} == {"three_digit"}
    trained = {t.prompt for t in g["rl"]} | {m["messages"][0]["content"] for m in g["sft"]}
    assert not held_prompts & trained and not [p for p in held_prompts if p in "\n".join(g["corpus"])]


def test_eval_problems_never_appear_in_training_sets_or_corpus():
    g = synthetic.generate(0, 3000, 2000, 1000, 1000)
    held = {t.prompt for t in g["eval"]}
    assert len(held) == 1000 * len(SYNTHETIC) and {t.family for t in g["eval"]} == set(SYNTHETIC)
    train_prompts = {t.prompt for t in g["rl"]} | {m["messages"][0]["content"] for m in g["sft"]}
    held_chat = {t.chat_prompt for t in g["eval"]}
    assert not held & train_prompts and not held_chat & train_prompts
    corpus = "\n".join(g["corpus"])
    arithmetic_held = [t for t in g["eval"] if t.family == "arithmetic"]
    # The corpus writes worked sums as "Work out a op b: ..." lines and plain "a op b is c." facts inside
    # stories: neither form of a held-out problem appears.
    plain = [t.prompt.removeprefix("Work out ").removesuffix(":") + " is" for t in arithmetic_held]
    assert not [t for t in arithmetic_held if t.prompt in corpus]
    assert not [p for p in plain if f". {p} " in corpus]
    assert not [t for t in g["eval"] if t.family in ("uses_word", "three_digit") and t.prompt in corpus]


def test_uses_word_eval_asks_for_words_no_training_answer_of_the_family_contains():
    g = synthetic.generate(0, 3000, 2000, 1000, 1000)
    held = {t.spec["word"] for t in g["eval"] if t.family == "uses_word"}
    assert len(held) >= len(OBJECTS) // 5
    answers = [m["messages"][1]["content"] for m in g["sft"] if m["family"] == "uses_word"]
    assert len(answers) > 300 and not [a for a in answers if held & set(bare_words(a))]
    trained = [t for t in g["rl"] if t.family == "uses_word"]
    assert trained and not [t for t in trained if t.spec["word"] in held]
    sheets = "\n".join(d for d in g["corpus"] if "with the word" in d).lower()
    assert not [w for w in held if f"the word {w} " in sheets]
    # The stories still use them: a held-out word is a known token, asked for in a new place.
    story_words = {w for d in g["corpus"] if "with the word" not in d for w in bare_words(d)}
    assert held <= story_words


def test_no_single_answer_passes_more_than_five_percent_of_any_familys_eval_prompts():
    g = synthetic.generate(0, 0, 1, 1, 1000)
    for family in SYNTHETIC:
        tasks = [t for t in g["eval"] if t.family == family]
        candidates = {t.answer for t in tasks} | {t.chat_answer for t in tasks}
        best = max(sum(check_answer(family, t.spec, a)[1] for t in tasks) for a in candidates)
        assert best <= 0.05 * len(tasks), (family, best)


def test_word_limit_is_asked_only_in_the_rl_and_eval_sets():
    g = synthetic.generate(0, 3000, 2000, 1000, 1000)
    limits = [t for t in g["rl"] if t.family == "word_limit"]
    assert len(limits) == 6 * len(NAMES) * len(PLACES) - 1000
    assert len({t.prompt for t in limits}) == len(limits)  # each training-pool problem once
    assert {t.spec["max_words"] for t in limits} == set(range(4, 10))
    assert not [m for m in g["sft"] if m["family"] == "word_limit" or "Use at most" in m["messages"][0]["content"]]
    corpus = "\n".join(g["corpus"])
    assert "Use at most" not in corpus and not [t for t in limits if t.prompt in corpus]
    # Its own random stream: everything else is what it is without the family.
    others = {name: family for name, family in REGISTRY.items() if name != "word_limit"}
    without = synthetic.generate(0, 3000, 2000, 1000, 1000, families=others)
    assert without["corpus"] == g["corpus"] and without["sft"] == g["sft"]
    assert without["rl"] == [t for t in g["rl"] if t.family != "word_limit"]
    assert without["eval"] == [t for t in g["eval"] if t.family != "word_limit"]


def test_corpus_mixes_stories_arithmetic_and_constraints():
    corpus = synthetic.generate(0, 500, 1, 1, 1)["corpus"]
    assert sum(" plus 1 is " in d or " minus 1 minus " in d for d in corpus) > 100  # worked, carries and borrows
    assert sum('"' in d and "said" in d for d in corpus) > 100
    assert sum("in at most" in d for d in corpus) > 20
    assert len(set(corpus)) == len(corpus)


def test_checkers_accept_reference_answers_and_reject_wrong_ones():
    g = synthetic.generate(1, 0, 300, 300, 300)
    for t in g["eval"] + g["rl"]:
        assert check_answer(t.family, t.spec, t.answer) == (True, True)
        assert check_answer(t.family, t.spec, t.chat_answer) == (True, True)
    t = arithmetic_task(23, "plus", 58)
    assert t.answer == " 3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 81."
    assert arithmetic_task(40, "minus", 7).chat_answer == "10 minus 7 is 3, 4 minus 1 minus 0 is 3, so 33."
    assert check_answer("arithmetic", t.spec, " 3 plus 8 is 11, 2 plus 5 is 7, so 71.") == (True, False)
    assert check_answer("arithmetic", t.spec, " 82.") == (True, False)
    assert check_answer("arithmetic", t.spec, " eighty one") == (False, False)
    assert check_answer("arithmetic", t.spec, " 81. 4 plus 5 is 9.") == (True, True)  # the working is optional
    three = three_digit_task(243, "plus", 581)
    assert three.chat_answer == "3 plus 1 is 4, 4 plus 8 is 12, 2 plus 5 plus 1 is 8, so 824."
    # a borrow that crosses two columns, and a number under 100
    borrowed = " 13 minus 7 is 6, 10 minus 1 minus 0 is 9, 5 minus 1 minus 0 is 4, so 496."
    assert three_digit_task(503, "minus", 7).answer == borrowed
    assert three_digit_task(57, "plus", 960).answer == " 7 plus 0 is 7, 5 plus 6 is 11, 0 plus 9 plus 1 is 10, so 1017."
    assert check_answer("three_digit", three.spec, " so 823.") == (True, False)
    w = uses_word_task("Mia", "lamp", 5, "Mia found a lamp.")
    assert check_answer("uses_word", w.spec, "Mia found a big red lamp today.") == (True, False)  # too long
    assert check_answer("uses_word", w.spec, "Mia found a cup.") == (True, False)  # no word
    assert check_answer("uses_word", w.spec, "Tom found a lamp.") == (True, False)  # not about Mia
    assert check_answer("uses_word", w.spec, "Mia found a lamp") == (False, False)  # no period
    assert first_sentence(" Tom ran. Then he hid.\nnext") == "Tom ran."
    limit = word_limit_task("Mia", "park", 4, "Mia liked the park.")
    assert check_answer("word_limit", limit.spec, " Mia ran to the park.") == (True, False)  # five words
    assert check_answer("word_limit", limit.spec, " Mia left the park. More words follow here.") == (True, True)
    assert check_answer("word_limit", limit.spec, " Mia ran home.") == (True, False)  # not at the park
    assert check_answer("word_limit", limit.spec, " Tom left the park.") == (True, False)  # not about Mia
    assert check_answer("word_limit", limit.spec, " Mia.") == (False, False)  # one word is not a sentence
    assert check_answer("word_limit", limit.spec, " Mia left the park") == (False, False)
    assert check_answer("word_limit", limit.spec, " 9 plus 40.") == (False, False)  # not a sentence of words
    assert check_answer("word_limit", limit.spec, " park to Mia.") == (False, False)  # not capitalised
    assert check_answer("word_limit", limit.spec, ' "Park!" said Mia.') == (True, True)


def test_a_new_family_is_one_family_object_and_changes_nothing_else():
    # What a new module under stagelm/tasks/ provides; rl/eval-only, so it draws from its own stream.
    def ask(rng, problem):
        word = problem[0]
        return Task("echo", f"Echo {word}:", f"Say {word}.", f" {word}.", f"{word}.", {"word": word})

    def check(spec, completion):
        sentence = first_sentence(completion)
        return sentence.endswith("."), sentence == f"{spec['word']}."

    echo = Family("echo", lambda: [(w,) for w in ("Apple", "Boat", "Cup", "Drum")], ask, check)
    base = synthetic.generate(0, 50, 20, 20, 2)
    more = synthetic.generate(0, 50, 20, 20, 2, families={**REGISTRY, "echo": echo})
    assert [t for t in more["rl"] + more["eval"] if t.family != "echo"] == base["rl"] + base["eval"]
    assert more["corpus"] == base["corpus"] and more["sft"] == base["sft"]
    echoed = [t for t in more["eval"] if t.family == "echo"]
    assert len(echoed) == 2 and all(check(t.spec, t.answer) == (True, True) for t in echoed)
