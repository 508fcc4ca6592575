"""params.yaml read as DVC reads it, and checked against its typed sections (`stagelm.pipeline.config`).

`load_section` checks a raw mapping against its section's dataclass and fails on the
first unknown key, missing key or wrong value with one line naming the dotted key and
what was expected, e.g.

    pack.seq_len: expected a positive int, got 'long'

Stages load only the sections they read, with the section named literally
(`load_section(params, "training")`), so `stagelm deps` can read which keys a stage
depends on from its source.
"""

import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_regular_file
from stagelm.pipeline.config import (
    SECTIONS,
    SEED,
    DataConfig,
    DistillConfig,
    EvalConfig,
    MeshConfig,
    ModelConfig,
    inside,
)

# The most a params.yaml or dvc.yaml may hold: the shipped ones are ~11 and ~30 KB; one of hundreds
# of MB would otherwise be read whole into memory and parsed in pure Python.
MAX_YAML_BYTES = 1 << 20


def read_yaml(path: Path) -> Any:
    """A YAML file read as DVC reads it: ruamel.yaml's safe loader, YAML 1.2 (so `5e-05` is a
    float, as `dvc exp run -S` writes it), duplicate keys refused. Nothing in it is executed.
    The pure-Python parser: ruamel's C one overflows the C stack on deeply nested input,
    where Python's raises RecursionError (and the file is small: MAX_YAML_BYTES at most)."""
    data = read_regular_file(path, MAX_YAML_BYTES, "it holds settings, not data; give the project's own")
    try:
        return YAML(typ="safe", pure=True).load(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise StagelmError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8 YAML") from None
    except RecursionError:
        raise StagelmError(f"{path}: nested too deeply to read; flatten it") from None
    except YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where else ""
        problem = str(getattr(err, "problem", "") or "").split("\n")[0]
        what = f": {problem}" if problem else ""
        raise StagelmError(f"{path}: not valid YAML{line}{what}; fix the syntax") from None


def read_params(path: str | Path) -> dict[str, Any]:
    """Read params.yaml as a mapping, with DVC's number rules (`read_yaml`)."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_file():  # a folder, a device, a pipe, a dangling link
        raise StagelmError(f"{path}: not a regular file; pass --params the path of a params.yaml")
    if not path.is_file():
        raise StagelmError(f"{path}: params file not found; run from the project root or pass --params")
    params = read_yaml(path)
    if not isinstance(params, dict):
        raise StagelmError(f"{path}: expected a mapping of sections at the top level")
    return params


def did_you_mean(name: Any, known: Any) -> str:
    """` (did you mean 'x'?)` for the closest of `known` to a misspelled `name`, or ""."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


TOP_LEVEL = ("seed", *SECTIONS)  # every key params.yaml may hold at its top level


def validate_params(params: dict[str, Any]) -> dict[str, Any]:
    """Every key of params.yaml checked (unknown top-level keys too): the seed and each
    section's dataclass, by name. The `params` stage runs this before any other stage,
    so a misspelled key fails `dvc repro` even where a stage lists its keys one by one."""
    for key in params:
        if key not in TOP_LEVEL:
            raise StagelmError(
                f"{key}: unknown top-level key of params.yaml{did_you_mean(key, TOP_LEVEL)}; "
                f"expected {', '.join(TOP_LEVEL)}"
            )
    sections = {"seed": load_seed(params), **{name: load_section(params, name) for name in SECTIONS}}
    require_init_inside_inputs(sections["model"], sections["data"])
    require_lm_eval_tasks(sections["eval"], sections["data"])
    if sections["model"].init_from is None:  # else the teacher is the checkpoint's shape: `stagelm check` reads it
        require_prunable_student(sections["distill"], sections["model"], "model.")
        require_student_vocab(sections["distill"], sections["tokenizer"].vocab_size, "tokenizer.")
        require_tensor_split(sections["mesh"], sections["model"], "model.")
    require_tensor_split(sections["mesh"], sections["distill"].student, "distill.student.")
    return sections


def load_section(params: dict[str, Any], name: str) -> Any:
    """The typed, validated dataclass of section `name` of `params`."""
    if name not in params:
        raise StagelmError(f"{name}: section missing from params.yaml; add it (docs/params.md lists every key)")
    return parse_dataclass(SECTIONS[name], params[name], name)


def load_value(params: dict[str, Any], key: str) -> Any:
    """One validated value, `section.field`, for a stage that reads only that key of a section."""
    section, name = key.split(".")
    if section not in params or not isinstance(params[section], dict) or name not in params[section]:
        raise StagelmError(f"{key}: missing from params.yaml; add it (docs/params.md lists every key)")
    field = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
    hint = typing.get_type_hints(SECTIONS[section])[name]
    return check_value(params[section][name], hint, key, field.metadata.get("check"))


def load_seed(params: dict[str, Any]) -> int:
    if "seed" not in params:
        raise StagelmError("seed: missing from params.yaml; add e.g. `seed: 0`")
    return check_value(params["seed"], int, "seed", SEED)


def parse_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise StagelmError(f"{prefix}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            raise StagelmError(
                f"{prefix}.{key}: unknown key{did_you_mean(key, fields)}; expected one of {', '.join(fields)}"
            )
    values = {}
    for name, field in fields.items():
        if name not in raw:
            raise StagelmError(f"{prefix}.{name}: missing; add it to params.yaml")
        values[name] = check_value(raw[name], hints[name], f"{prefix}.{name}", field.metadata.get("check"))
    config = cls(**values)
    if hasattr(config, "validate"):  # rules across keys, named under `prefix`
        config.validate(prefix)
    return config


def check_value(value: Any, hint: Any, key: str, check: tuple | None = None) -> Any:
    """Return `value` converted to `hint`, or raise naming `key` and what was expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return check_value(value, hint, key, check)
    if dataclasses.is_dataclass(hint):
        return parse_dataclass(hint, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise StagelmError(f"{key}: expected a list, got {value!r}")
        items = tuple(check_value(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if check is not None and not check[0](items):
            raise StagelmError(f"{key}: expected {check[1].format(type='list')}, got {value!r}")
        return items
    words = {int: "int", float: "float", str: "string", bool: "bool"}[hint]
    ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = (float(value), True) if abs(value) < 2**1023 else (value, False)
    if ok and hint is float and not math.isfinite(value):  # .inf and .nan pass every comparison check
        raise StagelmError(f"{key}: expected a finite float, got {value!r}; write a number")
    if ok and check is not None and not check[0](value):
        ok = False
    if not ok:
        what = check[1].format(type=words) if check else ("an int" if hint is int else f"a {words}")
        raise StagelmError(f"{key}: expected {what}, got {shown(value)}")
    return value


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: an error line stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def section_dict(config: Any) -> dict[str, Any]:
    """A dataclass as a plain dict (tuples as lists), for JSON and fingerprints."""

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, tuple) else v

    return {k: plain(v) for k, v in dataclasses.asdict(config).items()}


def require_inputs(cfg: DataConfig, project: Path | None = None) -> None:
    """Fail, naming the key, unless `data.inputs` (a dependency of the download stage) is a
    folder inside the project (`project`, default the working directory, where dvc runs) and
    not the project itself: DVC cannot hash the folder that holds its own .dvc/ and outputs."""
    root = (project or Path.cwd()).resolve()
    folder = Path(cfg.inputs).expanduser()
    where = (root / folder).resolve()
    if where == root or not where.is_relative_to(root):
        place = "the project itself" if where == root else f"outside the project {root}"
        raise StagelmError(
            f"data.inputs: {cfg.inputs!r} is {place}; give a folder inside it that holds only your corpus "
            "and task files (the repository ships inputs/)"
        )
    if not where.is_dir():
        raise StagelmError(
            f"data.inputs: {cfg.inputs!r} is not a folder; create it (the repository ships inputs/) "
            "or point data.inputs at the folder holding your corpus"
        )


def require_init_inside_inputs(model: ModelConfig, data: DataConfig) -> None:
    """Refuse a `model.init_from` outside `data.inputs`: its files are inputs DVC must hash (the
    tokenizer and pretrain stages depend on that folder), as a corpus file's are."""
    if model.init_from is not None:
        path = model.init_from.partition(":")[2]
        if not inside(path, data.inputs):
            raise StagelmError(
                f"model.init_from: {path!r} lies outside data.inputs {data.inputs!r}, the folder DVC hashes; "
                "move the checkpoint into it"
            )


def require_prunable_student(cfg: DistillConfig, teacher: Any, whose: str) -> None:
    """With `distill.init: teacher` the student is the SFT model pruned (post.student.student_from_teacher):
    refuse, naming the key, a `distill.student` that pruning cannot cut from `teacher`, the SFT model's
    shape (the model section's, or model.init_from's checkpoint's), `whose` naming its sizes."""
    key = cfg.student.unprunable(teacher) if cfg.init == "teacher" else None
    if key is None:  # with init: scratch any student is trained from random weights, a larger one too
        return
    mine, theirs = getattr(cfg.student, key), getattr(teacher, key)
    if key in cfg.student.KEPT_WHEN_PRUNED:
        raise StagelmError(
            f"distill.student.{key}: {mine} differs from {whose}{key}, {theirs}; distill.init: teacher keeps the "
            f"teacher's embeddings and attention, so set it to {theirs} (or set distill.init: scratch)"
        )
    raise StagelmError(
        f"distill.student.{key}: {mine} is more than {whose}{key}, {theirs}; distill.init: teacher can only remove "
        "the teacher's layers and MLP units, so lower it (or set distill.init: scratch for a larger student)"
    )


def require_student_vocab(cfg: DistillConfig, vocab: int, whose: str) -> None:
    """Refuse a `distill.student.vocab_size` other than null or the teacher's `vocab` (the student shares the
    teacher's tokenizer), `whose` naming where that vocabulary is set. From params alone the teacher's is
    tokenizer.vocab_size: BPE fills it unless the corpus runs out of pairs to merge, so null is the one
    value that always fits."""
    mine = cfg.student.vocab_size
    if mine is not None and mine != vocab:
        raise StagelmError(
            f"distill.student.vocab_size: {mine} differs from {whose}vocab_size, {vocab}; the student shares the "
            "teacher's tokenizer, so set it to null"
        )


def require_tensor_split(mesh: MeshConfig, shape: Any, whose: str) -> None:
    """Refuse a `mesh.tensor` that does not divide what the tensor axis splits (infra.mesh.RULES: the attention
    heads, the key/value heads and the MLP width) in a model the stages run, `shape` (anything with ModelShape's
    sizes) with `whose` naming them: infra.mesh.fit_spec would keep those weights whole on every device."""
    if mesh.tensor <= 1:  # 1: nothing split; -1: the devices left over, known only when a stage starts
        return
    for key in ("n_heads", "n_kv_heads", "d_ff"):
        if getattr(shape, key) % mesh.tensor:
            raise StagelmError(
                f"mesh.tensor: {mesh.tensor} does not divide {whose}{key}, {getattr(shape, key)}; the tensor axis "
                f"splits the attention heads, key/value heads and MLP width ({whose}n_heads, n_kv_heads, d_ff), "
                "so set it to a divisor of all three, or 1"
            )


def lm_eval_installed() -> bool:
    """Whether EleutherAI's lm-eval (the `eval` extra) can be imported."""
    try:
        return importlib.util.find_spec("lm_eval") is not None
    except ValueError:  # in sys.modules as None: imports of it are blocked
        return False


def require_lm_eval_tasks(cfg: EvalConfig, data: DataConfig) -> None:
    """Refuse `eval.lm_eval_tasks` that cannot run: a task YAML outside `data.inputs` (the folder the
    eval stages depend on, so DVC hashes it), any task without lm-eval installed (the eval extra), or a
    task name lm-eval does not know (a name a listed YAML defines is not one: the eval stage looks names
    up in lm-eval's own tasks only)."""
    for task in cfg.lm_eval_tasks:
        if task.endswith((".yaml", ".yml")) and not inside(task, data.inputs):
            raise StagelmError(
                f"eval.lm_eval_tasks: {task!r} lies outside data.inputs {data.inputs!r}, the folder DVC hashes; "
                "move the task YAML and its data into it"
            )
    if cfg.lm_eval_tasks and not lm_eval_installed():
        raise StagelmError(
            "eval.lm_eval_tasks: lm-eval is not installed; pip install -e '.[eval]', or set eval.lm_eval_tasks: []"
        )
    names = [task for task in cfg.lm_eval_tasks if not task.endswith((".yaml", ".yml"))]
    if names:  # indexing lm-eval's tasks takes seconds: only for a list that names some
        from lm_eval.tasks import TaskManager

        known = TaskManager().all_tasks  # what the eval stage checks them against (measure.harness.evaluate_tasks)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise StagelmError(
                f"eval.lm_eval_tasks: {shown(unknown[0])} is not an lm-eval task{did_you_mean(unknown[0], known)}; "
                "`stagelm lm-eval ls tasks` lists them, or give a task YAML's path"
            )


# Peak learning rates above these are a from-scratch recipe's: on a trained checkpoint one update
# at the default training.lr (3e-3) took SmolLM2-135M's loss from 2.41 to 13.93 (issue 47).
FINE_TUNING_LR = {"training": 3e-4, "sft": 3e-4, "distill": 3e-4, "grpo": 1e-4, "dpo": 1e-4}


def fine_tuning_warnings(sections: dict[str, Any]) -> list[str]:
    """A warning line for each section whose peak rate would wreck a trained checkpoint (`model.init_from`),
    pointing at the fine-tuning preset (docs/huggingface.md)."""
    if sections["model"].init_from is None:
        return []
    lines = []
    for name, ceiling in FINE_TUNING_LR.items():
        cfg = sections[name]
        wide = name in ("sft", "dpo") and cfg.method == "lora"  # adapters start at zero: a LoRA rate may be higher
        if cfg.lr > ceiling * (10 if wide else 1):
            lines.append(
                f"warning: {name}.lr: {cfg.lr:g} is a from-scratch rate, and model.init_from starts from a trained "
                "checkpoint; use the fine-tuning preset (docs/huggingface.md#fine-tuning-a-checkpoint)"
            )
    return lines
