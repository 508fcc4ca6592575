"""Task families: the registry.

Each family is one module of this package (its problem space, how a problem is asked
in the completion and chat formats with a reference answer, its checker, and the
corpus text it contributes, if any), described by a `family.Family`:

- `arithmetic`: `Work out 23 plus 58:` → ` 3 plus 8 is 11, 2 plus 5 plus 1 is 8, so 81.`
  (taught: corpus sheets, SFT and RL);
- `three_digit`: arithmetic with a number of 100-999: `Work out 243 plus 581:` →
  ` 3 plus 1 is 4, 4 plus 8 is 12, 2 plus 5 plus 1 is 8, so 824.` (taught; a harder
  digit task for larger models);
- `uses_word`: a sentence about a name with a given word in at most k words (taught;
  its eval prompts ask for words held out of all its training text, so it tests copying);
- `word_limit`: a sentence about a person at a place in at most k words, asked only in
  the rl and eval sets;
- `final_answer`: a user's own graded task, read from task files only (GSM8K's rows as
  they are, or `prompt` and `answer`): the answer after `####` or the last number,
  compared numerically, else the text exactly.

An answer of the synthetic families is the completion's first sentence (up to and
including the first period).

Adding a family: write `tasks/<name>.py` ending in `FAMILY = Family(...)` (the four
above are the examples), import it below and add it to `REGISTRY`, and test its
checker against its own reference answers (tests/data/test_synthetic.py does so for every
registered family). The imports are explicit, so `stagelm deps` and dvc.yaml list
every family file, and editing one reruns the stages that read it.
"""

from typing import Any

from stagelm.infra.errors import StagelmError
from stagelm.tasks import arithmetic, final_answer, three_digit, uses_word, word_limit
from stagelm.tasks.family import Family, Task, first_sentence

REGISTRY: dict[str, Family] = {
    f.name: f for f in (arithmetic.FAMILY, three_digit.FAMILY, uses_word.FAMILY, word_limit.FAMILY, final_answer.FAMILY)
}
FAMILIES = tuple(REGISTRY)
SYNTHETIC = tuple(name for name, family in REGISTRY.items() if family.generated)  # what data.families may name

__all__ = [
    "FAMILIES",
    "REGISTRY",
    "SYNTHETIC",
    "Family",
    "Task",
    "check_answer",
    "first_sentence",
    "one_line",
    "require_families",
    "require_family_sets",
    "require_generated",
    "select",
    "spec_problem",
    "step_credit",
]


def one_line(families: list[str] | tuple[str, ...] | set[str]) -> bool:
    """Whether every family named answers in one line, so generation for them may stop at a newline."""
    return all(REGISTRY[f].one_line for f in families)


def check_answer(family: str, spec: dict[str, Any], completion: str) -> tuple[bool, bool]:
    """(well_formed, correct) for a completion of a task of `family`."""
    if family not in REGISTRY:
        raise StagelmError(f"unknown task family {family!r}; expected one of {list(FAMILIES)}")
    return REGISTRY[family].check(spec, completion)


def step_credit(family: str, spec: dict[str, Any], prompt: str, completion: str) -> float:
    """Partial credit in [0, 1] of a completion (`Family.step_credit`); for a family without
    steps, 1 for a right answer and 0 otherwise."""
    credit = REGISTRY[family].step_credit
    return credit(spec, prompt, completion) if credit else float(check_answer(family, spec, completion)[1])


def require_families(names: list[str] | tuple[str, ...], key: str) -> None:
    """Fail naming the params key unless every name is a registered family."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise StagelmError(f"{key}: unknown {unknown}; choose among {list(FAMILIES)}")


def require_family_sets(data: Any, grpo: Any, dpo: Any = None) -> None:
    """Fail, naming the key, unless `data.families`, `grpo.families` and (for pairs of its own answers)
    `dpo.families` are registered and every rl family is generated (when the rl set is the synthetic
    one); and unless `dpo.pairs: files` has data.pref_files: before any stage runs."""
    require_families(data.families, "data.families")
    require_generated(data.families, "data.families")
    sections = [("grpo", grpo)] + ([("dpo", dpo)] if dpo is not None and dpo.pairs == "self" else [])
    for name, section in sections:
        require_families(section.families, f"{name}.families")
        missing = [f for f in section.families if f not in data.families]
        if data.rl_files is None and missing:
            raise StagelmError(
                f"{name}.families: {missing} not in data.families {list(data.families)}, so the rl set has no "
                "prompt of it; add it to data.families or name another family"
            )
    if dpo is not None and dpo.pairs == "files" and not data.pref_files:
        raise StagelmError(
            "dpo.pairs: files needs data.pref_files (jsonl of prompt, chosen, rejected); set it, or dpo.pairs: self"
        )


def require_generated(names: list[str] | tuple[str, ...], key: str) -> None:
    """Fail naming the key if a family named comes from task files only (the synthetic source has none)."""
    files_only = [n for n in names if not REGISTRY[n].generated]
    if files_only:
        raise StagelmError(
            f"{key}: {files_only} come from task files only (data.sft_files, data.rl_files, data.eval_files), "
            f"not the synthetic source; choose among {list(SYNTHETIC)} here"
        )


def select(names: list[str] | tuple[str, ...], key: str) -> dict[str, Family]:
    """The families named (checked, see `require_families`; each one the synthetic source draws), in
    registry order: the order the synthetic source draws taught families in, whatever order the list gives."""
    require_families(names, key)
    require_generated(names, key)
    return {name: family for name, family in REGISTRY.items() if name in names}


def spec_problem(family: str, spec: Any) -> str | None:
    """What keeps `family`'s checker from grading a task with `spec` (naming the field), or None."""
    schema = REGISTRY[family].spec_schema
    if not isinstance(spec, dict):
        return f"spec: expected a JSON object with {sorted(schema)}, got {spec!r}"
    for key, kind in schema.items():
        if key not in spec:
            return f"spec.{key}: missing; the {family} checker needs {sorted(schema)}"
        value = spec[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is str and not value.strip()):
            what = "an integer" if kind is int else "a non-empty string"
            return f"spec.{key}: expected {what}, got {value!r}"
    return None
