"""Online distillation: a small student learns from a frozen teacher inside one train step.

The teacher and the student run on the same batch in the same jitted step; the
teacher's logits never leave the device. Per counted token the loss is

    alpha · T² · KL(softmax(teacher / T) ‖ softmax(student / T)) + (1 − alpha) · CE(student, label)

(Hinton et al., 2015: the T² keeps the soft term's gradient scale independent of T).
Only the student's parameters train: `STUDENT` selects them, so the optimizer state
and the checkpoints hold no copy of the teacher.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from stagelm.model import Decoder
from stagelm.trainstep import LossFn, lm_loss, next_token_targets

STUDENT = nnx.All(nnx.Param, nnx.PathContains("student"))


class Distiller(nnx.Module):
    """The student (trained) and the teacher (frozen) as one module for the train loop."""

    def __init__(self, student: Decoder, teacher: Decoder):
        self.student = student
        self.teacher = teacher


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
