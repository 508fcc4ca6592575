"""The params reference: every key of params.yaml with its type, default, allowed values and
meaning. Meanings and checks come from the typed configs (`stagelm.pipeline.config`, each field's
`param(doc, check)`), defaults from a params file. `stagelm params --markdown > docs/params.md`
writes the page; tests/test_docs.py fails when the committed page differs from what this prints."""

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import EXECUTION_KEYS, EXECUTION_SECTIONS, SECTIONS, SEED, SEED_DOC
from stagelm.pipeline.params import read_params, validate_params


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted, as `dvc exp run -S` takes it
    type: str
    default: Any
    allowed: str
    doc: str
    nested: bool = False  # a mapping of keys (sft.lora), listed after it


def type_words(hint: Any) -> str:
    """`int`, `float or null`, `list of string`: a field's type as the reference shows it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{type_words(inner)} or null"
    if origin is list:
        return f"list of {type_words(args[0])}"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return {int: "int", float: "float", str: "string", bool: "bool"}[hint]


def allowed_words(hint: Any, check: tuple | None) -> str:
    """What `stagelm check` accepts, in the words of its error message."""
    words = type_words(hint)
    if check is None:
        return f"any {words}"
    kind = "list" if words.startswith("list") else words.removesuffix(" or null")
    text = check[1].format(type=kind)
    return f"{text}, or null" if words.endswith("or null") else text


def section_doc(cls: type) -> str:
    """The first paragraph of a section's docstring (a dataclass without one gets `Name(...)`)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(f"{cls.__name__}("):
        raise StagelmError(f"{cls.__name__}: no docstring in stagelm.pipeline.config; say what the section is for")
    return " ".join(doc.split("\n\n")[0].split())


def section_keys(cls: type, prefix: str, values: Any) -> list[Key]:
    """The keys of dataclass `cls` under `prefix`, a nested mapping's keys after it."""
    if not isinstance(values, dict):
        raise StagelmError(f"{prefix}: missing from the params file, or not a mapping; add it")
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        name, hint = f"{prefix}.{field.name}", hints[field.name]
        doc = field.metadata.get("doc")
        if not doc:
            raise StagelmError(
                f"{name}: no meaning in stagelm.pipeline.config; declare the field with param(doc, check)"
            )
        if field.name not in values:
            raise StagelmError(f"{name}: missing from the params file; add it")
        nested = dataclasses.is_dataclass(hint)
        allowed = "" if nested else allowed_words(hint, field.metadata.get("check"))
        found.append(Key(name, type_words(hint), values[field.name], allowed, doc, nested))
        if nested:
            found += section_keys(hint, name, values[field.name])
    return found


def all_keys(params: dict[str, Any]) -> dict[str, list[Key]]:
    """Every key of a params mapping by section, `seed` first, in params.yaml's order."""
    if "seed" not in params:
        raise StagelmError("seed: missing from the params file; add it")
    keys = {"seed": [Key("seed", "int", params["seed"], SEED[1].format(type="int"), SEED_DOC)]}
    return keys | {name: section_keys(cls, name, params.get(name)) for name, cls in SECTIONS.items()}


def is_execution(key: str) -> bool:
    return key in EXECUTION_KEYS or key.split(".")[0] in EXECUTION_SECTIONS


def shown(value: Any) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, str) and (not value or value != value.strip() or ":" in value):
        return '"' + value + '"'
    return str(value)


def cell(text: str) -> str:
    """Text for a Markdown table cell: outside `code spans`, no character that would start
    emphasis, HTML or a link, or end the cell."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"([\\*_<>\[\]|])", r"\\\1", parts[i])
    return "`".join(parts)


INTRO = """\
# Params reference

Every key of `params.yaml`: its type, its default (the repository's `params.yaml`), the values
`stagelm check` accepts, and what it does. Set one for an experiment with
`dvc exp run -S training.lr=1e-3`; check a whole file in seconds with `stagelm check`.

Keys marked *execution setting* change how a stage runs, not what it computes: no stage lists
them as DVC params, so editing one reruns nothing, and a resumed run does not compare them.

This page is generated: `stagelm params --markdown > docs/params.md` writes it from the field
definitions in `src/stagelm/pipeline/config.py`, the one home of each meaning (`params.yaml` keeps short
comments on its values). A test fails when the page and the code differ.
"""

HEADER = "| key | type | default | allowed | meaning |\n| --- | --- | --- | --- | --- |"


def row(key: Key) -> str:
    default = "" if key.nested else f"`{shown(key.default)}`"
    setting = " *(execution setting)*" if is_execution(key.name) else ""
    return f"| `{key.name}` | {key.type} | {default} | {cell(key.allowed)} | {cell(key.doc)}{setting} |"


def valid_params(params_path: str | Path) -> dict:
    """params.yaml as read, once `stagelm check`'s checks of every key pass: a value shown as a
    key's default is one the stages would take."""
    params = read_params(params_path)
    validate_params(params)
    return params


def markdown(params_path: str | Path) -> str:
    """docs/params.md as `stagelm params --markdown` prints it."""
    sections = all_keys(valid_params(params_path))
    parts = [INTRO]
    for name, keys in sections.items():
        about = "" if name == "seed" else cell(section_doc(SECTIONS[name])) + "\n\n"
        parts.append(f"## {name}\n\n{about}{HEADER}\n" + "".join(row(k) + "\n" for k in keys))
    return "\n".join(parts)


def plain(params_path: str | Path) -> str:
    """`key: default  # meaning`, a line a key, for a terminal."""
    keys = [k for keys in all_keys(valid_params(params_path)).values() for k in keys if not k.nested]
    lines = [f"{k.name}: {shown(k.default)}" for k in keys]
    width = min(max(map(len, lines)), 44)
    return "".join(f"{line:<{width}}  # {k.doc}\n" for line, k in zip(lines, keys, strict=True))
