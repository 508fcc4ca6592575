"""The distilled student: its shape checked against the teacher, where it starts, the rows it learns on.

The student has the shape `distill.student` and everything else of the teacher (tokenizer,
RoPE, norms, dtypes). With `distill.init: teacher` it starts as the teacher pruned to that
shape, as Minitron does (Muralidharan et al., 2024: prune a trained model in depth and
width, then recover it by distillation): its layers evenly spaced, each MLP's strongest
units (`student_from_teacher`); with `scratch` from random weights drawn with `seed`.
The control run (`as_control`) trains the same student with the teacher's terms off.
"""

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.data.loader import MixedRows, PackedRows
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator, Sampling
from stagelm.infra.errors import StagelmError
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.modeldir import load_model, read_model_context
from stagelm.pipeline.config import DistillConfig
from stagelm.pipeline.params import require_prunable_student, require_student_vocab
from stagelm.post.distill import Distiller, OnPolicyBatches
from stagelm.train.batches import PackedBatches


def teacher_layers(n_teacher: int, n_student: int) -> list[int]:
    """The teacher layers a pruned student keeps: evenly spaced from the first to the last."""
    if n_student == 1:
        return [0]
    return [round(i * (n_teacher - 1) / (n_student - 1)) for i in range(n_student)]


def mlp_units(gate_up: np.ndarray, down: np.ndarray, keep: int) -> np.ndarray:
    """Indices (ascending) of the `keep` SwiGLU hidden units with the largest product of
    their gate, up and down weight norms: gate_up is (d, 2, f), down (f, d)."""
    score = np.linalg.norm(gate_up[:, 0], axis=0) * np.linalg.norm(gate_up[:, 1], axis=0)
    score = score * np.linalg.norm(down, axis=1)
    return np.sort(np.argsort(-score, kind="stable")[:keep])


def student_from_teacher(teacher: Decoder, cfg: DecoderConfig) -> Decoder:
    """A `cfg`-shaped student whose every weight is cut from the teacher's (refused first by
    `pipeline.params.require_prunable_student` where it cannot be).

    The embeddings, the final norm and each kept layer's norms and attention are copied
    whole; the layers are `teacher_layers`, and each kept MLP keeps the `cfg.d_ff` units
    of `mlp_units`. With the teacher's own shape it is the teacher, weight for weight.
    """
    student = Decoder(cfg, nnx.Rngs(0))  # every weight below is overwritten
    student.embed[...] = teacher.embed[...]
    student.final_norm[...] = teacher.final_norm[...]
    if not cfg.tie_embeddings:
        student.head[...] = teacher.head[...]
    for mine, index in zip(student.blocks, teacher_layers(teacher.cfg.n_layers, cfg.n_layers), strict=True):
        theirs = teacher.blocks[index]
        mine.attn_norm[...] = theirs.attn_norm[...]
        mine.mlp_norm[...] = theirs.mlp_norm[...]
        for name in ("q", "kv", "o"):
            getattr(mine.attn, name).w[...] = getattr(theirs.attn, name).w[...]
        gate_up, down = np.asarray(theirs.mlp.gate_up.w[...]), np.asarray(theirs.mlp.down.w[...])
        units = mlp_units(gate_up, down, cfg.d_ff)
        mine.mlp.gate_up.w[...] = jnp.asarray(gate_up[:, :, units])
        mine.mlp.down.w[...] = jnp.asarray(down[units])
    return student


def as_control(cfg: DistillConfig) -> DistillConfig:
    """The control run's section: the teacher's terms off (its own next-token loss only, as
    `distill.alpha: 0` would give, without running the teacher), no on-policy steps and no
    steps on the teacher's answers."""
    return dataclasses.replace(
        cfg, alpha=0.0, temperature=1.0, kl="forward", on_policy=0.0, sequence=0.0, sequence_temperature=0.0
    )


def check_student(cfg: DistillConfig, teacher: DecoderConfig, teacher_dir: Path) -> None:
    """Refuse, naming the key, a student the teacher's vocabulary or (when pruned) shape cannot give."""
    require_student_vocab(cfg, teacher.vocab_size, f"the teacher's ({teacher_dir}) ")  # as `stagelm check` does
    require_prunable_student(cfg, teacher, "the teacher's ")  # the check `stagelm check` runs on the model section


def distill_line(cfg: DistillConfig, n_student: int, n_teacher: int, init: str) -> str:
    """The distill stage's first line: the two models and the objective's settings."""
    return (
        f"distill: student {n_student:,} params from teacher {n_teacher:,} (init: {init}); alpha {cfg.alpha}, "
        f"T {cfg.temperature}, {cfg.kl} KL, data {cfg.data}, on-policy share {cfg.on_policy}, "
        f"teacher-answer share {cfg.sequence}"
    )


def distill_splits(cfg: DistillConfig, corpus: Path, sft: Path) -> list[Path]:
    """The packed splits `distill.data` names: the corpus, the SFT conversations, or both."""
    return {"corpus": [corpus], "sft": [sft], "both": [corpus, sft]}[cfg.data]


def distill_rows(splits: list[Path], tokenizer: Path) -> MixedRows:
    """The rows of `splits`, each checked against the teacher's tokenizer."""
    packed = [PackedRows(d) for d in splits]
    for rows in packed:
        rows.require_tokenizer(tokenizer)
    return MixedRows(packed)


def make_distiller(
    cfg: DistillConfig, teacher_dir: Path, seed: int, settings: dict[str, Any] | None = None
) -> tuple[Distiller, str]:
    """(the student beside its frozen teacher, how the student started) for `distill.init`; both
    compute with `settings` (`modeldir.run_settings`)."""
    teacher = load_model(teacher_dir, settings=settings)
    student_cfg = dataclasses.replace(teacher.cfg, **cfg.student.shape())
    if cfg.init == "scratch":
        return Distiller(Decoder(student_cfg, nnx.Rngs(seed)), teacher), "scratch"
    layers = teacher_layers(teacher.cfg.n_layers, student_cfg.n_layers)
    init = f"the teacher's layers {layers}, {student_cfg.d_ff} of {teacher.cfg.d_ff} MLP units"
    return Distiller(student_from_teacher(teacher, student_cfg), teacher), init


def generated_steps(cfg: DistillConfig, raw: Path | None) -> bool:
    """Whether the run trains on generated answers to the SFT prompts (the student's or the
    teacher's), which `raw`, the download stage's folder, must then give."""
    key = next((k for k in ("on_policy", "sequence") if getattr(cfg, k) > 0), None)
    if key and raw is None:
        raise StagelmError(f"distill.{key}: {getattr(cfg, key)} answers SFT prompts; pass --raw <download folder>")
    return key is not None


def on_policy_batches(
    cfg: DistillConfig, model: Distiller, rows: MixedRows, teacher_dir: Path, raw: Path, seed: int
) -> OnPolicyBatches:
    """The batches of a run with generated answers to the SFT prompts of `raw` (the download
    stage's folder): the student's on `distill.on_policy` of the steps, the teacher's (answered
    once, at the start) on `distill.sequence` of them, `rows` on the rest."""
    tokenizer, context = load_tokenizer(teacher_dir / "tokenizer.json"), read_model_context(teacher_dir)
    gen = Generator(model.student, tokenizer, context)
    conversations = read_raw(raw, "sft").to_pylist()
    local = cfg.batch_size * cfg.grad_accum
    packed = PackedBatches(rows, local // jax.process_count(), seed)
    teacher = Generator(model.teacher, tokenizer, context) if cfg.sequence > 0 else None
    sampling = Sampling(temperature=cfg.sequence_temperature)
    batches = OnPolicyBatches(
        packed, cfg.on_policy, nnx.graphdef(model), gen, conversations, local, seed, cfg.sequence, teacher, sampling
    )
    print(
        f"generated steps: {len(batches.prompts)} SFT prompts, answers of up to {batches.max_new} tokens"
        + (f" ({batches.skipped} longer prompts leave no room for one)" if batches.skipped else "")
        + (
            f"; the teacher's, at T={cfg.sequence_temperature:g}: {batches.answers[1].mean():.1f} tokens on average"
            if batches.answers is not None
            else ""
        ),
        flush=True,
    )
    return batches
