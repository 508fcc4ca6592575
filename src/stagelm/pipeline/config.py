"""params.yaml's sections as typed, frozen dataclasses: one per section, each key with its meaning.

Every section of params.yaml maps to a dataclass below, and every field carries its
one-line meaning and the check its value must pass (`param(doc, check)`: docs/params.md
is written from them). Rules across keys live in the section's `validate(prefix)`, which
names the keys as the user wrote them. Sections that share keys share a base
(`ModelShape`, `OptimizerConfig`), so each rule is written once. Reading params.yaml
and checking it against these is `stagelm.pipeline.params`.
"""

import dataclasses
import glob
import itertools
import os
import shlex
from pathlib import Path
from typing import Any, ClassVar

from stagelm.infra.errors import StagelmError

# --- value checks: (predicate, the words used in the error) -------------------------

# The text is what the error says was expected; {type} is filled with the field's type.
POSITIVE = (lambda v: v > 0, "a positive {type}")
NON_NEGATIVE = (lambda v: v >= 0, "a non-negative {type}")
FRACTION = (lambda v: 0 < v < 1, "a {type} in (0, 1)")
UNIT = (lambda v: 0 <= v <= 1, "a {type} in [0, 1]")


def at_most(bound: int) -> tuple:
    """A positive size no larger than `bound`, far past any run today (a model's sizes: import-hf's
    limits for a checkpoint's, interop.llama_state.LIMITS)."""
    return (lambda v: 0 < v <= bound, f"a positive {{type}} of at most {bound:,}")


DECAY = (lambda v: 0 <= v < 1, "a {type} in [0, 1) (at 1 the average never moves and Adam divides by 0)")
MESH_AXIS = (lambda v: v == -1 or v >= 1, "-1 (infer) or a positive {type}")
SEED = (lambda v: 0 <= v < 2**32, "an {type} in [0, 2**32)")  # what jax.random.key and numpy's generators take
# A decoder's real numbers, bounded as a checkpoint's are on import (interop.llama_state.FLOAT_LIMITS):
# an RMSNorm epsilon of 1e300 flattens every activation to zero, and trains on, silently.
NORM_EPS = (lambda v: 0 < v <= 0.1, "a positive {type} of at most 0.1")
ROPE_BASE = (lambda v: 0 < v <= 1e12, "a positive {type} of at most 1e12")
INIT_STD = (lambda v: 0 < v <= 1, "a positive {type} of at most 1")
NON_EMPTY = (lambda v: v.strip() != "", "a non-empty {type}")
SOURCE = (
    lambda v: v == "synthetic" or (v.startswith(("files:", "hf:")) and v.partition(":")[2].strip() != ""),
    "'synthetic', 'files:<path, folder or glob>' or 'hf:<dataset id or local dir>'",
)


def one_of(*choices: str) -> tuple:
    return (lambda v: v in choices, f"one of {', '.join(map(repr, choices))}")


def param(doc: str, check: tuple | None = None) -> Any:
    """A params.yaml key: its one-line meaning, the one home of it (docs/params.md is
    written from it by `stagelm params --markdown`), and the check its value must pass."""
    return dataclasses.field(metadata={"doc": doc, "check": check})


# The top-level `seed`, the one key no section holds.
SEED_DOC = "training initialisation and sampling; the data has its own data.seed"


# --- sections ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The download stage's corpus and task sets: where they come from and how they split."""

    source: str = param(
        "the corpus: synthetic, files:<path, folder or glob under data.inputs>, or hf:<dataset id or local dir>",
        SOURCE,
    )
    seed: int = param("the data's own seed: synthetic generator, train/val split, tokenizer sample", SEED)
    val_fraction: float = param("share of documents held out for validation", FRACTION)
    num_documents: int = param("synthetic corpus size, in documents", POSITIVE)
    text_field: str = param("the text column of jsonl, parquet and csv files and of hf datasets", NON_EMPTY)
    hf_revision: str | None = param(
        "a hub dataset's commit, tag or branch (required for a hub id; null for a local dir)"
    )
    hf_split: str = param("the split of an hf dataset to read")
    max_documents: int | None = param("cap on documents read from files or hf; null = all", POSITIVE)
    sft_files: str | None = param("jsonl of chats (`messages`) under data.inputs; null = the synthetic task families")
    rl_files: str | None = param("jsonl of RL prompts (`family`, `prompt`, `spec`) under data.inputs; null = synthetic")
    eval_files: str | None = param(
        "jsonl of eval prompts (`family`, `prompt`, `chat_prompt`, `spec`); null = synthetic"
    )
    pref_files: str | None = param(
        "jsonl of preference pairs (`prompt` or `messages`, `chosen`, `rejected`: TRL's format) under data.inputs, "
        "for dpo.pairs: files; null = none"
    )
    num_sft: int = param("synthetic SFT conversations", POSITIVE)
    num_rl: int = param("synthetic RL prompts", POSITIVE)
    num_eval: int = param("synthetic held-out prompts per task family", POSITIVE)
    # Names are checked against the registry (stagelm.tasks) by the download stage and `stagelm check`.
    families: list[str] = param("synthetic task families (stagelm.tasks) of the corpus and the SFT, RL and eval sets")
    # dvc.yaml lists it as the download stage's dependency, so an edited corpus reruns download and what follows.
    inputs: str = param(
        "the folder holding every local file the download reads (files:, a local hf:, *_files); DVC hashes it",
        (lambda v: bool(v.strip()), "a folder path"),
    )

    def local_inputs(self) -> list[tuple[str, str]]:
        """(key, path or glob) of every local file or folder the download stage reads."""
        scheme, _, arg = self.source.partition(":")
        found = [("data.source", arg)] if scheme == "files" or (scheme == "hf" and self.hf_revision is None) else []
        named = (
            ("data.sft_files", self.sft_files),
            ("data.rl_files", self.rl_files),
            ("data.eval_files", self.eval_files),
            ("data.pref_files", self.pref_files),
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


def inside(pattern: str, folder: str) -> bool:
    """Whether the files a path or glob names lie within `folder` (by their real paths, before any
    glob: a symbolic link under `folder` to a place outside it is outside, since DVC hashes the
    link, never what it points to)."""
    parts = Path(pattern).parts
    fixed = Path(*[p for p in itertools.takewhile(lambda p: not glob.has_magic(p), parts)] or ["."])
    base, root = os.path.realpath(os.path.expanduser(fixed)), os.path.realpath(os.path.expanduser(folder))
    return base == root or base.startswith(root.rstrip(os.sep) + os.sep)


# The smallest vocabulary the tokenizer stage can train: the byte-level alphabet and the special tokens
# it adds (data.tokenizer.SPECIAL_TOKENS: pad, bos, eos, user, assistant, end).
MIN_VOCAB = 256 + 6


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """The byte-level BPE tokenizer that the tokenizer stage trains on the train split."""

    vocab_size: int = param(
        "vocabulary size: the 256 bytes, the special tokens and the merges BPE learns",
        (  # at most: BPE's merge table must fit memory
            lambda v: MIN_VOCAB <= v <= 1 << 21,
            f"an {{type}} from {MIN_VOCAB} (the 256 bytes and {MIN_VOCAB - 256} special tokens) to 2,097,152",
        ),
    )
    min_frequency: int = param("a pair merges only if it occurs at least this often", POSITIVE)
    # A cap, so BPE's time and memory do not grow with the corpus.
    max_train_chars: int = param(
        "BPE trains on at most this many characters of the train split (a sample seeded by data.seed)", POSITIVE
    )


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """How the pack stage cuts the tokenized documents into rows of Arrow shards."""

    seq_len: int = param(
        "model context in tokens; a packed row holds seq_len + 1", (lambda v: v >= 2, "an {type} >= 2")
    )
    rows_per_shard: int = param("rows per Arrow shard of data/packed", POSITIVE)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes: the one home of these keys, shared by `model`, `distill.student`
    and `benchmark` (model.decoder.DecoderConfig adds the vocabulary and the rest at run time)."""

    d_model: int = param("residual width", at_most(1 << 16))
    n_layers: int = param("decoder blocks", at_most(1024))
    n_heads: int = param("attention heads; must divide d_model, with an even head size (RoPE)", at_most(1024))
    n_kv_heads: int = param("key/value heads (grouped-query attention); must divide n_heads", at_most(1024))
    d_ff: int = param("SwiGLU hidden width", at_most(1 << 20))

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
    """The decoder pretrain builds (Llama-style), or the checkpoint it starts from."""

    rope_theta: float = param("RoPE base frequency", ROPE_BASE)
    norm_eps: float = param("RMSNorm epsilon", NORM_EPS)
    tie_embeddings: bool = param("share the input embedding with the output projection")
    dtype: str = param(
        "compute dtype of activations and matmuls (bfloat16 on accelerators)", one_of("float32", "bfloat16", "float16")
    )
    param_dtype: str = param("dtype the parameters are stored and updated in", one_of("float32", "bfloat16"))
    remat: str = param(
        "what each block keeps for the backward pass: none (everything), dots (the projections' "
        "outputs; attention and elementwise work recomputed), block (nothing: the whole block recomputed)",
        one_of("none", "dots", "block"),
    )
    attention: str = param(
        "the training pass's attention kernel: auto (splash on a TPU for rows a multiple of 128 tokens, "
        "else the reference), reference (XLA, every device) or splash (Pallas, TPU only)",
        one_of("auto", "reference", "splash"),
    )
    scan_layers: bool = param("run the blocks as one scan: compile time no longer grows with n_layers")
    init_std: float = param("standard deviation of the initial weights", INIT_STD)
    # A checkpoint brings its architecture and tokenizer; the run settings (RUN_SETTINGS) still apply.
    init_from: str | None = param(
        "null = from scratch; hf:<folder> (a transformers Llama checkpoint) or gguf:<file> (a llama GGUF) "
        "under data.inputs, which DVC hashes",
        (
            lambda v: (v.startswith("hf:") and len(v) > 3) or (v.startswith("gguf:") and len(v) > 5),
            "null, hf:<folder> or gguf:<file>",
        ),
    )

    RUN_SETTINGS: ClassVar[tuple[str, ...]] = ("dtype", "param_dtype", "remat", "attention", "scan_layers")

    def settings(self) -> dict[str, Any]:
        """How the model runs, not what it is: applied to a checkpoint as to a new model."""
        return {k: getattr(self, k) for k in self.RUN_SETTINGS}

    def architecture(self) -> dict[str, Any]:
        """The DecoderConfig fields of this section (everything but init_from)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "init_from"}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on a warmup and a schedule, the run's length and its evals: the one home of
    these keys, which `training` (pretrain), `sft`, `distill` and `grpo` each carry in
    their own section, so DVC reruns only the stage whose key changed."""

    section: ClassVar[str]  # the params section, for the keys an error names
    # The key that sets how many rows a micro-batch holds, named when the rows do not fit the mesh.
    batch_key: ClassVar[str]

    lr: float = param("AdamW's peak learning rate", POSITIVE)
    min_lr_ratio: float = param("final learning rate of cosine and wsd, as a fraction of lr", UNIT)
    schedule: str = param("learning-rate schedule after the warmup", one_of("constant", "cosine", "wsd"))
    warmup_steps: int = param("linear warmup steps; must be below steps", NON_NEGATIVE)
    decay_fraction: float = param("wsd only: share of the steps spent decaying", UNIT)
    weight_decay: float = param(
        "AdamW's decoupled weight decay (never on norms)",
        (lambda v: 0 <= v <= 100, "a non-negative {type} of at most 100 (lr × it past 1 flips every weight's sign)"),
    )
    decay_embeddings: bool = param("apply weight decay to the embeddings too")
    beta1: float = param("Adam's first-moment decay", DECAY)
    beta2: float = param("Adam's second-moment decay", DECAY)
    eps: float = param("Adam's epsilon", POSITIVE)
    grad_clip: float = param("global-norm gradient clip; 0 = off", NON_NEGATIVE)
    steps: int = param("optimizer steps", (lambda v: 0 < v <= 10**9, "a positive {type} of at most 1,000,000,000"))
    eval_every: int = param("steps between val-loss evaluations", POSITIVE)
    eval_batches: int = param("val batches per evaluation", POSITIVE)
    # Execution settings: read by the stage, but no DVC param and not in the resume
    # fingerprint, since they do not change what is learned.
    log_every: int = param("steps between logged train metrics", POSITIVE)
    checkpoint_every: int = param("steps between Orbax checkpoints", POSITIVE)
    keep_checkpoints: int = param("checkpoints kept for resume", POSITIVE)

    def validate(self, prefix: str) -> None:
        if self.warmup_steps >= self.steps:
            raise StagelmError(f"{prefix}.warmup_steps: {self.warmup_steps} must be below {prefix}.steps {self.steps}")


@dataclasses.dataclass(frozen=True)
class TrainingConfig(OptimizerConfig):
    """An optimizer run on packed rows: pretrain's `training`, and the base of sft and distill."""

    section: ClassVar[str] = "training"
    batch_key: ClassVar[str] = "training.batch_size"

    batch_size: int = param("global rows per microbatch", at_most(1 << 20))
    grad_accum: int = param("microbatches accumulated per optimizer step", POSITIVE)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh's axis sizes; their product is the device count."""

    data: int = param("data-parallel axis size; -1 = the devices left over", MESH_AXIS)
    fsdp: int = param("fully-sharded data-parallel axis size: parameters and optimizer state split along it", MESH_AXIS)
    tensor: int = param("tensor-parallel axis size", MESH_AXIS)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the pack and training stages start: one local process, or behind a cluster launcher."""

    command: str = param(
        'prefix the pack and training stages start behind, e.g. srun --ntasks-per-node=4; "" = one local process'
    )
    initialization_timeout: int = param(
        "seconds a process of several waits to join JAX's runtime before it gives up, naming the coordinator",
        POSITIVE,
    )

    def validate(self, prefix: str) -> None:
        try:
            shlex.split(self.command)
        except ValueError as err:
            raise StagelmError(f"{prefix}.command: {err} in {self.command!r}; fix the quoting") from None


def temperature_key(temperature: float) -> str:
    """The key of one of `eval.temperatures` in an eval's `chat_temperatures` (metrics.json), which
    the eval writes and the report reads: `1` and `1.0` are both "1.0"."""
    return str(float(temperature))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What the eval stage measures on each model: val loss, and answers to the held-out prompts."""

    batch_size: int = param("val rows per batch of the loss", POSITIVE)
    max_batches: int | None = param("val batches for the loss; null = the whole val split", POSITIVE)
    task_batch_size: int = param("eval prompts generated together", POSITIVE)
    max_examples: int | None = param("eval prompts per task family; null = the whole eval set", POSITIVE)
    max_new_tokens: int = param("longest generated answer, in tokens", POSITIVE)
    sample_temperature: float = param(
        "chat prompts answered once more, sampled at this temperature; 0 = skip", NON_NEGATIVE
    )
    pass_k: int = param("sampled chat answers per prompt for pass@1 and pass@k; 0 = skip", NON_NEGATIVE)
    pass_k_prompts: int | None = param("prompts per family for pass@k, the first of the eval set; null = all", POSITIVE)
    temperatures: list[float] = param(
        "chat prompts answered sampled at each of these temperatures too (chat_temperatures; the best is the "
        "model's sampling default in its export); [] = skip",
        (lambda ts: all(0 < t <= 2 for t in ts) and len(set(ts)) == len(ts), "a {type} of distinct numbers in (0, 2]"),
    )
    temperature_prompts: int | None = param(
        "prompts per family for chat_temperatures, the first of the eval set; null = all", POSITIVE
    )
    lm_eval_tasks: list[str] = param(
        "lm-eval tasks each eval stage runs (lm-eval's task names, or task YAML files under data.inputs; "
        "docs/evaluating.md); [] = none",
        (lambda ts: all(t.strip() for t in ts) and len(set(ts)) == len(ts), "a {type} of distinct task names"),
    )
    lm_eval_limit: int | None = param("documents scored per lm-eval task; null = all", POSITIVE)

    def validate(self, prefix: str) -> None:
        if self.pass_k and not self.sample_temperature:
            raise StagelmError(
                f"{prefix}.pass_k: {self.pass_k} samples need {prefix}.sample_temperature > 0; set one to 0"
            )


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """The sample stage's prompts and sampling settings."""

    prompts: list[str] = param("prompts a base model completes (format completion), one sample each")
    chat_prompts: list[str] = param("user turns a tuned model answers (format chat), one sample each")
    max_new_tokens: int = param("tokens generated per prompt", POSITIVE)
    temperature: float = param("sampling temperature; 0 = greedy", NON_NEGATIVE)
    top_k: int = param("sample among the k likeliest tokens; 0 = off", NON_NEGATIVE)
    top_p: float = param(
        "nucleus sampling: the smallest set of tokens holding this much probability",
        (lambda v: 0 < v <= 1, "a {type} in (0, 1]"),
    )

    def validate(self, prefix: str) -> None:
        for key in ("prompts", "chat_prompts"):
            if not getattr(self, key) or any(not p for p in getattr(self, key)):
                raise StagelmError(f"{prefix}.{key}: expected a non-empty list of non-empty strings")


# The decoder's projections (model.decoder.Projection), by name: LoRA targets them, the HF mapping
# and the merge walk them. Attention: q, kv, o; MLP: gate_up, down.
PROJECTIONS = ("q", "kv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al., 2021) on the decoder's projections."""

    rank: int = param("rank of the LoRA adapters", POSITIVE)
    alpha: float = param(
        "adapters' output is scaled by alpha / rank", POSITIVE
    )  # the adapter's output is scaled by alpha / rank (Hu et al., 2021)
    dropout: float = param("dropout on the adapters' input", (lambda v: 0 <= v < 1, "a {type} in [0, 1)"))
    targets: list[str] = param(
        "projections that get adapters",
        (lambda v: bool(v) and set(v) <= set(PROJECTIONS), f"a non-empty list drawn from {list(PROJECTIONS)}"),
    )


@dataclasses.dataclass(frozen=True)
class SftConfig(TrainingConfig):
    """Supervised fine-tuning of the pretrained model on the SFT conversations, full or LoRA."""

    section: ClassVar[str] = "sft"
    batch_key: ClassVar[str] = "sft.batch_size"

    method: str = param(
        "full: every weight trains; lora: only adapters train, and the saved model is merged", one_of("full", "lora")
    )
    # Replay, so tuning for chat costs the language model less.
    replay: float = param(
        "share of the rows drawn from the pretraining corpus; 0 = the SFT conversations alone",
        (lambda v: 0 <= v < 1, "a {type} in [0, 1)"),
    )
    lora: LoraConfig = param("the adapters of method lora (the keys below)")


@dataclasses.dataclass(frozen=True)
class StudentConfig(ModelShape):
    """The distilled student's shape; everything else (RoPE, norms, dtypes) is the teacher's."""

    vocab_size: int | None = param("null = the teacher's vocabulary (any other value is refused)", POSITIVE)

    # distill.init: teacher keeps the teacher's embeddings and attention whole (these sizes its own) and
    # some of its layers and MLP units (at most these): post.student.student_from_teacher.
    KEPT_WHEN_PRUNED: ClassVar[tuple[str, ...]] = ("d_model", "n_heads", "n_kv_heads")
    CUT_WHEN_PRUNED: ClassVar[tuple[str, ...]] = ("n_layers", "d_ff")

    def unprunable(self, teacher: Any) -> str | None:
        """The first size of this shape that a student pruned from `teacher` (anything with ModelShape's
        sizes: a DecoderConfig, the model section) cannot have, or None."""
        for key in self.KEPT_WHEN_PRUNED:
            if getattr(self, key) != getattr(teacher, key):
                return key
        return next((key for key in self.CUT_WHEN_PRUNED if getattr(self, key) > getattr(teacher, key)), None)


@dataclasses.dataclass(frozen=True)
class DistillConfig(TrainingConfig):
    """Distillation of the SFT model (the teacher) into a smaller student."""

    section: ClassVar[str] = "distill"
    batch_key: ClassVar[str] = "distill.batch_size"

    alpha: float = param("weight of the soft term alpha·T²·KL(teacher‖student); 1 - alpha goes to the hard CE", UNIT)
    temperature: float = param(
        "temperature T of both distributions in the soft term",
        (lambda v: 0 < v <= 100, "a {type} in (0, 100] (the soft term is scaled by T², which overflows beyond)"),
    )
    kl: str = param(
        "the soft term's direction: forward KL(teacher‖student) or reverse KL(student‖teacher) (MiniLLM)",
        one_of("forward", "reverse"),
    )
    data: str = param(
        "what the student trains on: the packed corpus, the SFT conversations, or both", one_of("corpus", "sft", "both")
    )
    # teacher: post.student.student_from_teacher
    init: str = param(
        "scratch: random weights (seed); teacher: the teacher pruned to the student's shape",
        one_of("scratch", "teacher"),
    )
    on_policy: float = param("share of steps on the student's own answers to SFT prompts, scored by the teacher", UNIT)
    sequence: float = param(
        "share of steps on the teacher's own answers to SFT prompts, as labels (sequence-level KD)", UNIT
    )
    sequence_temperature: float = param(
        "the temperature the teacher answers at for distill.sequence, once at the start; 0 = greedy", NON_NEGATIVE
    )
    student: StudentConfig = param("the student's shape; RoPE, norms, dtypes and tokenizer are the teacher's")

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.on_policy + self.sequence > 1:
            raise StagelmError(
                f"{prefix}.sequence: {self.sequence} plus {prefix}.on_policy {self.on_policy} is more than every step; "
                "lower one"
            )


@dataclasses.dataclass(frozen=True)
class GrpoConfig(OptimizerConfig):
    """GRPO on the SFT model: sampled answers to RL prompts, rewarded by each task family's checker."""

    section: ClassVar[str] = "grpo"
    batch_key: ClassVar[str] = "grpo.prompts_per_step"  # a micro-batch is a share of a rollout's samples

    families: list[str] = param("RL task families rewarded, and so targeted")
    seed: int | None = param(
        "the seed of the stage's own draws (the prompts' order, the samples, LoRA's init); null = the top-level "
        "seed. Another value reruns GRPO alone on the same SFT model: the spread of one recipe's runs",
        SEED,
    )
    objective: str = param(
        "grpo: the clipped-ratio policy gradient on group advantages; rft: the next-token loss on the "
        "rollout's correct samples (rejection-sampling fine-tuning, expert iteration)",
        one_of("grpo", "rft"),
    )
    positive_weight: float = param("grpo objective: weight of the samples with a positive advantage", NON_NEGATIVE)
    negative_weight: float = param(
        "grpo objective: weight of the samples with a negative advantage (0 with 1 above: positive-only, RAFT-like)",
        NON_NEGATIVE,
    )
    rft_keep: str = param(
        "rft objective: train on every correct sample of a prompt, or on one (the first drawn)", one_of("all", "one")
    )
    prompt_weight: str = param(
        "flat: every prompt's samples weigh as the objective says; unsure: times the share of the prompt's "
        "samples that are wrong (prompts always answered right weigh nothing; with dynamic_sampling they "
        "make way for more prompts), rescaled to keep the weights' mean size",
        one_of("flat", "unsure"),
    )
    reward: str = param(
        "outcome: 1 for a right answer; steps: partial credit for each right step of a wrong answer "
        "(families with checkable steps)",
        one_of("outcome", "steps"),
    )
    prompts_per_step: int = param(
        "prompts per rollout; an update trains on prompts_per_step × group_size samples", POSITIVE
    )
    group_size: int = param(
        "samples per prompt, compared with each other",
        (lambda v: v >= 2, "an {type} >= 2 (advantages compare samples of one prompt)"),
    )
    temperature: float = param("rollout sampling temperature", POSITIVE)
    top_p: float = param("rollout nucleus sampling", (lambda v: 0 < v <= 1, "a {type} in (0, 1]"))
    max_new_tokens: int = param("longest sampled answer, in tokens", POSITIVE)
    format_weight: float = param("reward added for a well-formed answer, beside correctness", NON_NEGATIVE)
    clip_eps: float = param("the policy ratio is clipped below at 1 - clip_eps", FRACTION)
    clip_eps_high: float | None = param("the ratio's upper clip is 1 + this (DAPO: 0.28); null = clip_eps", POSITIVE)
    advantages: str = param(
        "group: (reward - group mean) / group std (GRPO); none: reward - group mean (Dr. GRPO)", one_of("group", "none")
    )
    dynamic_sampling: bool = param("drop groups whose samples all scored alike and draw more prompts (DAPO)")
    max_draws: int = param("dynamic sampling: prompt batches drawn per rollout at most", POSITIVE)
    revisit: float = param(
        "share of a rollout's first batch of prompts given to the previous rollout's unsure ones (samples that "
        "scored differently; the lowest mean reward first): more samples where the policy is unsure; 0 = fresh only",
        UNIT,
    )
    kl_coef: float = param(
        "weight of the k3 KL to the reference on the rollouts' tokens; 0 = off (the reference does not score them, "
        "and train/kl is not logged)",
        (lambda v: 0 <= v <= 1000, "a {type} in [0, 1000] (beyond, the KL term overflows the loss)"),
    )
    entropy_coef: float = param(
        "weight of the policy's entropy on the completion tokens, subtracted from the loss: > 0 keeps it "
        "exploring, < 0 sharpens it; 0 = off",
        (lambda v: -10 <= v <= 10, "a {type} in [-10, 10]"),
    )
    anchor_coef: float = param(
        "weight of the k3 KL to the reference on SFT answers of the unrewarded families; 0 = off", NON_NEGATIVE
    )  # weight of the KL to the reference on SFT rows (0: none)
    anchor_rows: int = param("SFT conversations per update for the anchor term", POSITIVE)
    updates_per_rollout: int = param("optimizer steps per rollout; rollouts = steps / updates_per_rollout", POSITIVE)
    grad_accum: int = param(
        "micro-batches per update: a rollout is sampled and its gradient summed in this many chunks", POSITIVE
    )
    optimizer: str = param(
        "adamw, or sgd with momentum beta1 (no second moment, so no early steps scaled by a noisy variance)",
        one_of("adamw", "sgd"),
    )
    method: str = param(
        "full: every weight trains; lora: only adapters train, and the saved model is merged; norms: only the "
        "RMSNorm gains train (the logits' scale, per feature and layer: a sharpening at little cost)",
        one_of("full", "lora", "norms"),
    )
    lora: LoraConfig = param("the adapters of method lora (the keys below)")

    @property
    def batch_size(self) -> int:
        """Rows per micro-batch (and per val batch): a rollout's samples over `grad_accum`."""
        return self.prompts_per_step * self.group_size // self.grad_accum

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.prompts_per_step % self.grad_accum:
            raise StagelmError(
                f"{prefix}.grad_accum: {self.grad_accum} does not divide {prefix}.prompts_per_step "
                f"{self.prompts_per_step} (each micro-batch holds whole groups)"
            )
        if self.objective == "grpo" and self.positive_weight == 0 and self.negative_weight == 0:
            raise StagelmError(
                f"{prefix}.positive_weight: 0 with {prefix}.negative_weight 0 trains on no sample; set one above 0"
            )
        if not self.families:  # the names are checked against stagelm.tasks by the grpo stage and `stagelm check`
            raise StagelmError(f"{prefix}.families: empty list; name the rl task families to reward")
        for key in ("steps", "eval_every", "checkpoint_every"):
            if getattr(self, key) % self.updates_per_rollout:
                raise StagelmError(
                    f"{prefix}.{key}: {getattr(self, key)} is not a multiple of {prefix}.updates_per_rollout "
                    f"{self.updates_per_rollout} (checkpoints and evals fall between rollouts)"
                )


@dataclasses.dataclass(frozen=True)
class DpoConfig(TrainingConfig):
    """Direct preference optimisation of the SFT model on pairs of answers: its own, graded, or a user's."""

    section: ClassVar[str] = "dpo"
    batch_key: ClassVar[str] = "dpo.batch_size"

    pairs: str = param(
        "self: the SFT model's own answers to the rl prompts, a right one chosen over a wrong one of the same "
        "prompt; files: data.pref_files' pairs",
        one_of("self", "files"),
    )
    families: list[str] = param("self: the rl task families whose prompts are answered and graded")
    seed: int | None = param(
        "the seed of the stage's own draws (prompts, samples, pair order, LoRA's init); null = the top-level seed",
        SEED,
    )
    rounds: int = param(
        "self: rounds of fresh pairs drawn from the current policy (iterative DPO); steps split evenly over them",
        POSITIVE,
    )
    prompts: int = param("self: rl prompts answered per round", POSITIVE)
    samples: int = param(
        "self: answers sampled per prompt; a prompt gives pairs when some are right and some wrong",
        (lambda v: v >= 2, "an {type} >= 2 (a pair needs two answers)"),
    )
    pairs_per_prompt: int = param("self: pairs taken from one prompt's answers at most", POSITIVE)
    reference_answers: bool = param(
        "self: a prompt none of whose answers is right pairs the rl set's reference answer (its chat_answer, "
        "where the row has one) over a wrong one; false: such prompts give no pair"
    )
    temperature: float = param("self: sampling temperature of the answers", POSITIVE)
    max_new_tokens: int = param("self: longest sampled answer, in tokens", POSITIVE)
    sample_rows: int = param("self: answers sampled together (the KV cache holds this many rows)", POSITIVE)
    span: str = param(
        "self: answer, each answer's tokens count whole; fork, only each answer's first token after the tokens "
        "both share (where a wrong working goes wrong: a step-level preference, as Step-DPO). A user's pairs "
        "(files) always count whole",
        one_of("answer", "fork"),
    )
    loss: str = param(
        "sigmoid: -log σ(β·margin) (DPO, Rafailov et al. 2023); ipo: (margin - 1/(2β))² on length-averaged "
        "log-probs (IPO, Azar et al. 2023)",
        one_of("sigmoid", "ipo"),
    )
    beta: float = param("β: how far from the reference the policy may move (smaller: further)", POSITIVE)
    nll_weight: float = param(
        "weight of the chosen answer's length-averaged next-token loss beside the pair's loss (RPO, Pang et al. "
        "2024); 0 = off",
        NON_NEGATIVE,
    )
    method: str = param(
        "full: every weight trains; lora: only adapters train, and the saved model is merged", one_of("full", "lora")
    )
    lora: LoraConfig = param("the adapters of method lora (the keys below)")

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.steps % self.rounds:
            raise StagelmError(
                f"{prefix}.rounds: {self.rounds} does not divide {prefix}.steps {self.steps} (each round trains "
                "as many steps)"
            )
        if self.pairs == "self" and not self.families:
            raise StagelmError(f"{prefix}.families: empty list; name the rl task families whose answers pair up")


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig(ModelShape):
    """The shape the benchmark stage times (random weights and tokens) and how often."""

    vocab_size: int = param("vocabulary of the timed model (random weights and tokens)", POSITIVE)
    seq_len: int = param("tokens per row of the timed train step", POSITIVE)
    batch_size: int = param("rows per timed train step", POSITIVE)
    dtype: str = param("compute dtype of the timed model", one_of("float32", "bfloat16", "float16"))
    prompt_len: int = param("decode: prompt tokens per row", POSITIVE)
    new_tokens: int = param("decode: tokens generated per row", POSITIVE)
    matmul_size: int = param(
        "n of the (n, n) @ (n, n) fp32 matmul whose FLOP/s is the machine's practical peak", POSITIVE
    )
    warmup: int = param("untimed calls before the timed ones", NON_NEGATIVE)
    repetitions: int = param(
        "timed calls of each measure (min, median, max)",
        (lambda v: v >= 10, "an {type} >= 10 (min / median / max need samples)"),
    )
    # Naive decoding (the whole prefix recomputed per token) runs 16-25x slower than cached, so
    # at batch 8 its ten repetitions were most of the stage; a few give its median to well
    # within the speedup the claims check (>= 5x).
    naive_repetitions: int = param("timed calls of naive full-prefix decoding, the KV cache's reference", POSITIVE)
    # Asked for, never inferred from what happens to be installed: the stage's outputs must not
    # depend on an untracked package, and the peer's timed calls doubled the stage's time.
    torch_peer: bool = param(
        "also time the same shape in plain PyTorch (src/stagelm/measure/torch_peer.py); needs torch, "
        "which stagelm never installs"
    )


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What the export stages write beside the transformers checkpoint."""

    gguf_dtype: str = param(
        "dtype of model.gguf's matrices (llama.cpp): float32, float16, bfloat16, or q8_0 / q4_0 (blocks of 32; "
        "a matrix whose rows are not a multiple of 32 stays float16); norms stay float32",
        one_of("float32", "float16", "bfloat16", "q8_0", "q4_0"),
    )


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
    "dpo": DpoConfig,
    "benchmark": BenchmarkConfig,
    "export": ExportConfig,
}


def section_keys(name: str) -> list[str]:
    """The dotted keys of section `name`, in its dataclass's order."""
    return [f"{name}.{f.name}" for f in dataclasses.fields(SECTIONS[name])]


# Keys that tune how a stage runs, not what it computes: never DVC params, never hashed
# into a resume fingerprint. Whole sections of them first.
EXECUTION_SECTIONS = ("mesh", "launch")
EXECUTION_KEYS = {
    f"{section}.{key}"
    for section in ("training", "sft", "distill", "grpo", "dpo")
    for key in ("log_every", "checkpoint_every", "keep_checkpoints")
}
