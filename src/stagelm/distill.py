"""Online distillation: a small student learns from a frozen teacher inside one train step.

The teacher and the student run on the same batch in the same jitted step; the
teacher's logits never leave the device. Per counted token the loss is

    alpha · T² · KL(softmax(teacher / T) ‖ softmax(student / T)) + (1 − alpha) · CE(student, label)

(Hinton et al., 2015: the T² keeps the soft term's gradient scale independent of T).
Only the student's parameters train: `STUDENT` selects them, so the optimizer state
and the checkpoints hold no copy of the teacher.

The student starts from scratch or from the teacher itself, pruned to the student's
shape (`student_from_teacher`), as Minitron does (Muralidharan et al., 2024: prune a
trained model in depth and width, then recover it by distillation).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stagelm.config import StudentConfig
from stagelm.errors import StagelmError
from stagelm.model import Decoder, DecoderConfig
from stagelm.trainstep import LossFn, lm_loss, next_token_targets

STUDENT = nnx.All(nnx.Param, nnx.PathContains("student"))


class Distiller(nnx.Module):
    """The student (trained) and the teacher (frozen) as one module for the train loop."""

    def __init__(self, student: Decoder, teacher: Decoder):
        self.student = student
        self.teacher = teacher


def check_prunable(student: StudentConfig, teacher: DecoderConfig, teacher_dir: Path) -> None:
    """Refuse, naming the key, a `distill.student` shape that `student_from_teacher` cannot cut from the teacher."""
    for key in ("d_model", "n_heads", "n_kv_heads"):
        mine, theirs = getattr(student, key), getattr(teacher, key)
        if mine != theirs:
            raise StagelmError(
                f"distill.student.{key}: {mine} differs from the teacher's {theirs} ({teacher_dir}); with "
                "distill.init: teacher the student keeps the teacher's embeddings and attention, so set it "
                "to the teacher's (or distill.init: scratch)"
            )
    for key in ("n_layers", "d_ff"):
        mine, theirs = getattr(student, key), getattr(teacher, key)
        if mine > theirs:
            raise StagelmError(
                f"distill.student.{key}: {mine} is more than the teacher's {theirs} ({teacher_dir}); "
                "distill.init: teacher can only remove layers and MLP units"
            )


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
    """A `cfg`-shaped student whose every weight is cut from the teacher's (`check_prunable` first).

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


def soft_kl(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float) -> jax.Array:
    """KL(teacher_T ‖ student_T) per position, over the last (vocab) axis."""
    log_t = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    log_s = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    return jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)


def distill_loss(alpha: float, temperature: float) -> LossFn:
    """The distillation loss over counted tokens (padding, document boundaries and loss_mask as in `lm_loss`)."""

    def loss(model: Distiller, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
        inputs, targets, weights = next_token_targets(batch)
        args = (inputs["tokens"], inputs["segment_ids"], inputs["positions"])
        student = model.student(*args, rng).astype(jnp.float32)
        teacher = jax.lax.stop_gradient(model.teacher(*args).astype(jnp.float32))
        ce = optax.softmax_cross_entropy_with_integer_labels(student, targets)
        kl = soft_kl(teacher, student, temperature)
        per_token = alpha * temperature**2 * kl + (1 - alpha) * ce
        return (
            jnp.sum(per_token * weights),
            jnp.sum(weights),
            {"kl": jnp.sum(kl * weights), "ce": jnp.sum(ce * weights)},
        )

    return loss


def student_lm_loss(model: Distiller, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
    """The student's own next-token loss: val/loss of a distillation run, comparable across alpha."""
    return lm_loss(model.student, batch, rng)
