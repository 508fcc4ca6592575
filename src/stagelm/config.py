"""Typed, frozen views of params.yaml: one dataclass per section.

Every section of params.yaml maps to a dataclass below. `load_section` checks a raw
mapping against it and fails on the first unknown key, missing key or wrong value
with one line naming the dotted key and what was expected, e.g.

    pack.seq_len: expected a positive int, got 'long'

Constraints live next to each field (`metadata={"check": ...}`), so the rules a key
obeys are read in one place; rules across keys live in the section's `validate(prefix)`,
which names the keys as the user wrote them. Sections that share keys share a base
(`ModelShape`, `OptimizerConfig`), so each rule is written once. Stages load only the
sections they read.
"""

import dataclasses
import difflib
import glob
import itertools
import math
import os
import shlex
import types
import typing
from pathlib import Path
from typing import Any, ClassVar

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from stagelm.errors import StagelmError

# --- value checks: (predicate, the words used in the error) -------------------------

# The text is what the error says was expected; {type} is filled with the field's type.
POSITIVE = (lambda v: v > 0, "a positive {type}")
NON_NEGATIVE = (lambda v: v >= 0, "a non-negative {type}")
FRACTION = (lambda v: 0 < v < 1, "a {type} in (0, 1)")
UNIT = (lambda v: 0 <= v <= 1, "a {type} in [0, 1]")
MESH_AXIS = (lambda v: v == -1 or v >= 1, "-1 (infer) or a positive {type}")
SEED = (lambda v: 0 <= v < 2**32, "an {type} in [0, 2**32)")  # what jax.random.key and numpy's generators take


def one_of(*choices: str) -> tuple:
    return (lambda v: v in choices, f"one of {', '.join(map(repr, choices))}")


def checked(check: tuple, **kwargs: Any) -> Any:
    """A dataclass field whose value must pass `check`."""
    return dataclasses.field(metadata={"check": check}, **kwargs)


# --- sections ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str  # synthetic | files:<path or glob> | hf:<dataset id or local dataset dir>
    seed: int = checked(SEED)  # the data's own seed, apart from the training seed
    val_fraction: float = checked(FRACTION)
    num_documents: int = checked(POSITIVE)  # synthetic corpus size
    text_field: str  # column holding the text for files/hf sources
    hf_revision: str | None  # pin of a hub dataset (branch, tag or commit)
    hf_split: str
    max_documents: int | None = checked(POSITIVE)  # cap on documents read from files/hf
    sft_files: str | None  # jsonl with `messages`; default: the synthetic task families
    rl_files: str | None  # jsonl with `family`, `prompt`, `spec`
    eval_files: str | None  # jsonl with `family`, `prompt`, `chat_prompt`, `spec`
    num_sft: int = checked(POSITIVE)  # synthetic SFT conversations
    num_rl: int = checked(POSITIVE)  # synthetic RL prompts
    num_eval: int = checked(POSITIVE)  # synthetic held-out prompts per task family
    # The synthetic task families (stagelm.tasks) in the SFT, RL and eval sets and the corpus
    # sheets; names are checked against the registry by the download stage and `stagelm check`.
    families: list[str]
    # The folder holding every local file the download reads (a `files:` corpus, a local
    # `hf:` dataset, the task files): dvc.yaml lists it as the download stage's dependency,
    # so an edited corpus reruns download and what follows.
    inputs: str = checked((lambda v: bool(v.strip()), "a folder path"))

    def local_inputs(self) -> list[tuple[str, str]]:
        """(key, path or glob) of every local file or folder the download stage reads."""
        scheme, _, arg = self.source.partition(":")
        found = [("data.source", arg)] if scheme == "files" or (scheme == "hf" and self.hf_revision is None) else []
        named = (
            ("data.sft_files", self.sft_files),
            ("data.rl_files", self.rl_files),
            ("data.eval_files", self.eval_files),
        )
        return found + [(key, value) for key, value in named if value]

    def validate(self, prefix: str) -> None:
        if not self.families:
            raise StagelmError(f"{prefix}.families: empty list; name the synthetic task families to generate")
        for key, pattern in self.local_inputs():
            if pattern and not inside(pattern, self.inputs):
                raise StagelmError(
                    f"{key}: {pattern!r} lies outside {prefix}.inputs {self.inputs!r}, the folder DVC hashes for the "
                    f"download stage; move the files into it or set {prefix}.inputs to a folder holding them"
                )


def require_inputs(cfg: DataConfig) -> None:
    """Fail, naming the key, when `data.inputs` (a dependency of the download stage) is not a folder."""
    if not Path(cfg.inputs).expanduser().is_dir():
        raise StagelmError(
            f"data.inputs: {cfg.inputs!r} is not a folder; create it (the repository ships inputs/) "
            "or point data.inputs at the folder holding your corpus"
        )


def inside(pattern: str, folder: str) -> bool:
    """Whether the files a path or glob names lie within `folder` (by their paths, before any glob)."""
    parts = Path(pattern).parts
    fixed = Path(*[p for p in itertools.takewhile(lambda p: not glob.has_magic(p), parts)] or ["."])
    base, root = os.path.abspath(os.path.expanduser(fixed)), os.path.abspath(os.path.expanduser(folder))
    return base == root or base.startswith(root.rstrip(os.sep) + os.sep)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = checked(POSITIVE)
    min_frequency: int = checked(POSITIVE)
    # BPE trains on at most this many characters of the train split (a seeded uniform sample
    # when the split is larger), so its time and memory do not grow with the corpus.
    max_train_chars: int = checked(POSITIVE)


@dataclasses.dataclass(frozen=True)
class PackConfig:
    seq_len: int = checked((lambda v: v >= 2, "an {type} >= 2"))
    rows_per_shard: int = checked(POSITIVE)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes: the one home of these keys, shared by `model`, `distill.student`
    and `benchmark` (model.DecoderConfig adds the vocabulary and the rest at run time)."""

    d_model: int = checked(POSITIVE)
    n_layers: int = checked(POSITIVE)
    n_heads: int = checked(POSITIVE)
    n_kv_heads: int = checked(POSITIVE)
    d_ff: int = checked(POSITIVE)

    def validate(self, prefix: str) -> None:
        """Attention shape rules, naming the keys under `prefix` (e.g. distill.student)."""
        if self.d_model % self.n_heads:
            raise StagelmError(f"{prefix}.n_heads: {self.n_heads} does not divide {prefix}.d_model {self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise StagelmError(
                f"{prefix}.n_kv_heads: {self.n_kv_heads} does not divide {prefix}.n_heads {self.n_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise StagelmError(f"{prefix}.n_heads: the head size d_model/n_heads must be even for RoPE")

    def shape(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelShape)}


@dataclasses.dataclass(frozen=True)
class ModelConfig(ModelShape):
    rope_theta: float = checked(POSITIVE)
    norm_eps: float = checked(POSITIVE)
    tie_embeddings: bool
    dtype: str = checked(one_of("float32", "bfloat16", "float16"))  # compute dtype
    param_dtype: str = checked(one_of("float32", "bfloat16"))
    remat: str = checked(one_of("none", "block"))
    init_std: float = checked(POSITIVE)
    # null: train from scratch with the fields above. hf:<local dir>: start from a transformers
    # Llama checkpoint there (its architecture and tokenizer; dtype, param_dtype and remat still apply).
    init_from: str | None = checked((lambda v: v.startswith("hf:") and len(v) > 3, "null or hf:<local dir>"))

    def architecture(self) -> dict[str, Any]:
        """The DecoderConfig fields of this section (everything but init_from)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "init_from"}


def init_dir(init_from: str | None) -> Path | None:
    """The local checkpoint directory of `model.init_from`, or None (from scratch)."""
    if init_from is None:
        return None
    path = Path(init_from[3:]).expanduser()
    if not (path / "config.json").is_file():
        raise StagelmError(f"model.init_from: {path} has no config.json; give a local transformers checkpoint dir")
    return path


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on a warmup and a schedule, the run's length and its evals: the one home of
    these keys, which `training` (pretrain), `sft`, `distill` and `grpo` each carry in
    their own section, so DVC reruns only the stage whose key changed."""

    section: ClassVar[str]  # the params section, for the keys an error names

    lr: float = checked(POSITIVE)
    min_lr_ratio: float = checked(UNIT)  # final lr of cosine / wsd as a fraction of lr
    schedule: str = checked(one_of("constant", "cosine", "wsd"))
    warmup_steps: int = checked(NON_NEGATIVE)
    decay_fraction: float = checked(UNIT)  # wsd: share of steps spent decaying
    weight_decay: float = checked(NON_NEGATIVE)
    decay_embeddings: bool  # apply weight decay to embeddings too (never to norms)
    beta1: float = checked(UNIT)
    beta2: float = checked(UNIT)
    eps: float = checked(POSITIVE)  # Adam's epsilon
    grad_clip: float = checked(NON_NEGATIVE)  # global-norm clip; 0 turns it off
    steps: int = checked(POSITIVE)
    eval_every: int = checked(POSITIVE)
    eval_batches: int = checked(POSITIVE)
    # Execution settings: read by the stage, but no DVC param and not in the resume
    # fingerprint, since they do not change what is learned.
    log_every: int = checked(POSITIVE)
    checkpoint_every: int = checked(POSITIVE)
    keep_checkpoints: int = checked(POSITIVE)

    def validate(self, prefix: str) -> None:
        if self.warmup_steps >= self.steps:
            raise StagelmError(f"{prefix}.warmup_steps: {self.warmup_steps} must be below {prefix}.steps {self.steps}")


@dataclasses.dataclass(frozen=True)
class TrainingConfig(OptimizerConfig):
    """An optimizer run on packed rows: pretrain's `training`, and the base of sft and distill."""

    section: ClassVar[str] = "training"

    batch_size: int = checked(POSITIVE)  # global rows per microbatch
    grad_accum: int = checked(POSITIVE)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = checked(MESH_AXIS)
    fsdp: int = checked(MESH_AXIS)
    tensor: int = checked(MESH_AXIS)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    # A prefix for the training stages' commands ("" = run them as one local process),
    # e.g. "srun --nodes=2 --ntasks-per-node=4": see stagelm.distributed.
    command: str

    def validate(self, prefix: str) -> None:
        try:
            shlex.split(self.command)
        except ValueError as err:
            raise StagelmError(f"{prefix}.command: {err} in {self.command!r}; fix the quoting") from None


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    batch_size: int = checked(POSITIVE)  # val rows per batch
    max_batches: int | None = checked(POSITIVE)  # null = the whole val split
    task_batch_size: int = checked(POSITIVE)  # prompts generated together
    max_examples: int | None = checked(POSITIVE)  # per task family; null = the whole eval set
    max_new_tokens: int = checked(POSITIVE)
    sample_temperature: float = checked(NON_NEGATIVE)  # chat answered once more, sampled; 0 = not
    pass_k: int = checked(NON_NEGATIVE)  # chat samples per prompt at sample_temperature for pass@k; 0 = not
    pass_k_prompts: int | None = checked(POSITIVE)  # the first this many prompts per family; null = all

    def validate(self, prefix: str) -> None:
        if self.pass_k and not self.sample_temperature:
            raise StagelmError(
                f"{prefix}.pass_k: {self.pass_k} samples need {prefix}.sample_temperature > 0; set one to 0"
            )


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    prompts: list[str]
    max_new_tokens: int = checked(POSITIVE)
    temperature: float = checked(NON_NEGATIVE)  # 0 = greedy
    top_k: int = checked(NON_NEGATIVE)  # 0 = off
    top_p: float = checked((lambda v: 0 < v <= 1, "a {type} in (0, 1]"))

    def validate(self, prefix: str) -> None:
        if not self.prompts or any(not p for p in self.prompts):
            raise StagelmError(f"{prefix}.prompts: expected a non-empty list of non-empty strings")


# The decoder's projections (model.Projection), by name: LoRA targets them, the HF mapping
# and the merge walk them. Attention: q, kv, o; MLP: gate_up, down.
PROJECTIONS = ("q", "kv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = checked(POSITIVE)
    alpha: float = checked(POSITIVE)  # the adapter's output is scaled by alpha / rank (Hu et al., 2021)
    dropout: float = checked((lambda v: 0 <= v < 1, "a {type} in [0, 1)"))
    targets: list[str] = checked(
        (lambda v: bool(v) and set(v) <= set(PROJECTIONS), f"a non-empty list drawn from {list(PROJECTIONS)}")
    )


@dataclasses.dataclass(frozen=True)
class SftConfig(TrainingConfig):
    section: ClassVar[str] = "sft"

    method: str = checked(one_of("full", "lora"))
    # Share of the training rows drawn from the pretraining corpus (replay), so tuning for
    # chat costs the language model less; 0 = the SFT conversations alone.
    replay: float = checked((lambda v: 0 <= v < 1, "a {type} in [0, 1)"))
    lora: LoraConfig


@dataclasses.dataclass(frozen=True)
class StudentConfig(ModelShape):
    """The distilled student's shape; everything else (RoPE, norms, dtypes) is the teacher's."""

    vocab_size: int | None = checked(POSITIVE)  # null = the teacher's; any other value is refused


@dataclasses.dataclass(frozen=True)
class DistillConfig(TrainingConfig):
    section: ClassVar[str] = "distill"

    alpha: float = checked(UNIT)  # weight of the soft (KL) term; 1 - alpha goes to the hard CE
    temperature: float = checked(POSITIVE)
    data: str = checked(one_of("corpus", "sft", "both"))
    # scratch: the student starts from random weights (seed); teacher: from the teacher's own
    # weights, pruned to the student's shape (distill.student_from_teacher)
    init: str = checked(one_of("scratch", "teacher"))
    # share of the steps that train on the student's own sampled answers to SFT prompts, toward
    # the teacher's per-token distribution (on-policy distillation, stagelm.distill); 0 = none
    on_policy: float = checked(UNIT)
    student: StudentConfig


@dataclasses.dataclass(frozen=True)
class GrpoConfig(OptimizerConfig):
    section: ClassVar[str] = "grpo"
    grad_accum: ClassVar[int] = 1  # one update on every sample of a rollout

    families: list[str]  # the rl task families rewarded (and so targeted)
    prompts_per_step: int = checked(POSITIVE)
    group_size: int = checked((lambda v: v >= 2, "an {type} >= 2 (advantages compare samples of one prompt)"))
    temperature: float = checked(POSITIVE)
    top_p: float = checked((lambda v: 0 < v <= 1, "a {type} in (0, 1]"))
    max_new_tokens: int = checked(POSITIVE)
    format_weight: float = checked(NON_NEGATIVE)  # reward for a well-formed answer, added to correctness
    clip_eps: float = checked(FRACTION)
    clip_eps_high: float | None = checked(POSITIVE)  # the upper clip, 1 + this (DAPO); null = clip_eps
    advantages: str = checked(one_of("group", "none"))  # group: (r − mean) / std in the group; none: r − mean
    dynamic_sampling: bool  # drop groups whose samples all scored alike and draw more prompts (DAPO)
    max_draws: int = checked(POSITIVE)  # dynamic sampling: prompt batches drawn per rollout at most
    kl_coef: float = checked(NON_NEGATIVE)
    anchor_coef: float = checked(NON_NEGATIVE)  # weight of the KL to the reference on SFT rows (0: none)
    anchor_rows: int = checked(POSITIVE)  # SFT rows per update for that term
    updates_per_rollout: int = checked(POSITIVE)  # steps (optimizer steps) / updates_per_rollout rollouts
    method: str = checked(one_of("full", "lora"))  # lora: only adapters train; the saved model is merged
    lora: LoraConfig

    @property
    def batch_size(self) -> int:
        """Rows per update (and per val batch): every sample of one rollout."""
        return self.prompts_per_step * self.group_size

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if not self.families:  # the names are checked against stagelm.tasks by the grpo stage and `stagelm check`
            raise StagelmError(f"{prefix}.families: empty list; name the rl task families to reward")
        for key in ("steps", "eval_every", "checkpoint_every"):
            if getattr(self, key) % self.updates_per_rollout:
                raise StagelmError(
                    f"{prefix}.{key}: {getattr(self, key)} is not a multiple of {prefix}.updates_per_rollout "
                    f"{self.updates_per_rollout} (checkpoints and evals fall between rollouts)"
                )


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig(ModelShape):
    """The shape the benchmark stage times (random weights and tokens) and how often."""

    vocab_size: int = checked(POSITIVE)
    seq_len: int = checked(POSITIVE)
    batch_size: int = checked(POSITIVE)
    dtype: str = checked(one_of("float32", "bfloat16", "float16"))
    prompt_len: int = checked(POSITIVE)  # decode: prompt tokens per row
    new_tokens: int = checked(POSITIVE)  # decode: tokens generated per row
    matmul_size: int = checked(POSITIVE)  # the (n, n) @ (n, n) matmul whose FLOP/s is the practical peak
    warmup: int = checked(NON_NEGATIVE)
    repetitions: int = checked((lambda v: v >= 10, "an {type} >= 10 (min / median / max need samples)"))
    # Naive decoding (the whole prefix recomputed per token) runs 16-25x slower than cached, so
    # at batch 8 its ten repetitions were most of the stage; a few give its median to well
    # within the speedup the claims check (>= 5x).
    naive_repetitions: int = checked(POSITIVE)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "pack": PackConfig,
    "model": ModelConfig,
    "training": TrainingConfig,
    "mesh": MeshConfig,
    "launch": LaunchConfig,
    "eval": EvalConfig,
    "sample": SampleConfig,
    "sft": SftConfig,
    "distill": DistillConfig,
    "grpo": GrpoConfig,
    "benchmark": BenchmarkConfig,
}


def section_keys(name: str) -> list[str]:
    """The dotted keys of section `name`, in its dataclass's order."""
    return [f"{name}.{f.name}" for f in dataclasses.fields(SECTIONS[name])]


# Keys that tune how a stage runs, not what it computes: never DVC params, never hashed
# into a resume fingerprint.
EXECUTION_KEYS = {
    f"{section}.{key}"
    for section in ("training", "sft", "distill", "grpo")
    for key in ("log_every", "checkpoint_every", "keep_checkpoints")
}


# --- parsing -------------------------------------------------------------------------


def read_yaml(path: Path) -> Any:
    """A YAML file read as DVC reads it: ruamel.yaml's safe loader, YAML 1.2 (so `5e-05` is a
    float, as `dvc exp run -S` writes it), duplicate keys refused. Nothing in it is executed.
    The pure-Python parser: ruamel's C one overflows the C stack on deeply nested input,
    where Python's raises RecursionError (and params.yaml is small)."""
    try:
        return YAML(typ="safe", pure=True).load(path.read_bytes().decode("utf-8"))
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
    return {"seed": load_seed(params), **{name: load_section(params, name) for name in SECTIONS}}


def load_section(params: dict[str, Any], name: str) -> Any:
    """The typed, validated dataclass of section `name` of `params`."""
    if name not in params:
        raise StagelmError(f"{name}: section missing from params.yaml; add it (see README)")
    return parse_dataclass(SECTIONS[name], params[name], name)


def load_value(params: dict[str, Any], key: str) -> Any:
    """One validated value, `section.field`, for a stage that reads only that key of a section."""
    section, name = key.split(".")
    if section not in params or not isinstance(params[section], dict) or name not in params[section]:
        raise StagelmError(f"{key}: missing from params.yaml; add it (see README)")
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
