"""Online distillation: a small student learns from a frozen teacher inside one train step.

The teacher and the student run on the same batch in the same jitted step; the
teacher's logits never leave the device. Per counted token the loss is

    alpha · T² · KL(softmax(teacher / T) ‖ softmax(student / T)) + (1 − alpha) · CE(student, label)

(Hinton et al., 2015: the T² keeps the soft term's gradient scale independent of T), or
with `distill.kl: reverse` the KL the other way, KL(student_T ‖ teacher_T) (Gu et al.,
2024, MiniLLM: mode-seeking, so a small student does not spread its mass over what it
cannot fit).
Only the student's parameters train: `STUDENT` selects them, so the optimizer state
and the checkpoints hold no copy of the teacher.

With `distill.on_policy` > 0 that share of the steps trains on the student's own
answers instead (on-policy distillation; Agarwal et al., 2024, "On-Policy Distillation
of Language Models", GKD): the student samples an answer to each of a batch of SFT
prompts with its current weights, and learns the teacher's per-token distribution on
them, T² · KL(teacher_T ‖ student_T) over the answer's tokens and no hard term (the
sampled tokens are no labels). The student then meets, and is corrected on, the
mistakes it makes itself, which fixed data never shows it.

The student starts from scratch or from the teacher itself, pruned to the student's
shape (`stagelm.post.student`).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stagelm.infer.generate import Generator, Sampling
from stagelm.infra import mesh
from stagelm.infra.errors import StagelmError
from stagelm.model.decoder import Decoder
from stagelm.train.batches import BatchSource
from stagelm.train.step import LossFn, lm_loss, next_token_targets

STUDENT = nnx.All(nnx.Param, nnx.PathContains("student"))
SAMPLED = "student_sampled"  # the key marking a batch of the student's own answers


class Distiller(nnx.Module):
    """The student (trained) and the teacher (frozen) as one module for the train loop."""

    def __init__(self, student: Decoder, teacher: Decoder):
        self.student = student
        self.teacher = teacher


def soft_kl(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float, kl: str = "forward") -> jax.Array:
    """Per position, over the last (vocab) axis: KL(teacher_T ‖ student_T) ("forward": the student
    covers every token the teacher gives mass to) or KL(student_T ‖ teacher_T) ("reverse": the
    student puts its mass where the teacher's is, MiniLLM's choice for small students)."""
    log_t = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    log_s = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    if kl == "reverse":
        return jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)
    return jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)


def distill_loss(alpha: float, temperature: float, kl: str = "forward") -> LossFn:
    """The distillation loss over counted tokens (padding, document boundaries and loss_mask as in
    `lm_loss`), its soft term the `kl` direction of `soft_kl`."""

    def loss(model: Distiller, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
        inputs, targets, weights = next_token_targets(batch)
        args = (inputs["tokens"], inputs["segment_ids"], inputs["positions"])
        student = model.student(*args, rng).astype(jnp.float32)
        teacher = jax.lax.stop_gradient(model.teacher(*args).astype(jnp.float32))
        ce = optax.softmax_cross_entropy_with_integer_labels(student, targets)
        soft = soft_kl(teacher, student, temperature, kl)
        # The student's own answers (on-policy rows) learn the teacher's distribution only.
        hard = 0.0 if SAMPLED in batch else 1 - alpha
        per_token = (1 - hard) * temperature**2 * soft + hard * ce
        return (
            jnp.sum(per_token * weights),
            jnp.sum(weights),
            {"kl": jnp.sum(soft * weights), "ce": jnp.sum(ce * weights)},
        )

    return loss


def student_lm_loss(model: Distiller, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
    """The student's own next-token loss: val/loss of a distillation run, comparable across alpha."""
    return lm_loss(model.student, batch, rng)


def on_policy_step(step: int, share: float) -> bool:
    """Whether 1-based `step` trains on the student's answers: `share` of the steps, evenly spread."""
    return int(step * share) > int((step - 1) * share)


def first_turn(messages: list[dict]) -> list[dict]:
    """A conversation's messages through its first user turn (a system message may open it)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[: users[0] + 1] if users else messages[:1]


class OnPolicyBatches:
    """`distill.on_policy` of the steps: the student's sampled answers to SFT prompts; the rest
    from `data` (the packed rows). A `train.batches.BatchSource`; its state is both parts'."""

    def __init__(
        self,
        data: BatchSource,
        share: float,
        graphdef: Any,
        gen: Generator,
        conversations: list[dict],
        rows: int,
        seed: int,
    ):
        self.data, self.share, self.graphdef, self.gen, self.rows, self.seed = data, share, graphdef, gen, rows, seed
        chat = gen.chat
        # Each conversation's opening through its first user turn, ready for the assistant's answer.
        prompts = [chat.prompt(first_turn(c["messages"])) for c in conversations]
        # Room for the longest reference answer (and its end token): the answers the student should give.
        self.max_new = max(sum(chat.conversation(c["messages"])[1]) for c in conversations) + 1
        # Prompts that leave that room in the context (a prompt that does not is no use: its answer would be cut).
        self.prompts = [p for p in prompts if len(p) + self.max_new <= gen.capacity]
        if len(self.prompts) < rows:
            raise StagelmError(
                f"distill.on_policy: {len(self.prompts)} of {len(prompts)} SFT prompts leave room for a "
                f"{self.max_new}-token answer in the context of {gen.capacity}, fewer than the {rows} rows of "
                "a step; raise pack.seq_len or set distill.on_policy to 0"
            )
        self.skipped = len(prompts) - len(self.prompts)
        self.stop = gen.stop_mask(chat=True, stop_at_newline=True)
        self.sampling = Sampling(temperature=1.0)
        self.step = 0

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        self.step += 1
        if not on_policy_step(self.step, self.share):
            return self.data.next(params, frozen)
        student = nnx.state(nnx.merge(self.graphdef, params, frozen).student)
        chosen = np.random.default_rng([self.seed, self.step]).choice(len(self.prompts), self.rows, replace=False)
        tokens, seg, pos = self.gen.layout([self.prompts[i] for i in chosen], self.max_new)
        key = jax.random.fold_in(jax.random.key(self.seed), self.step)
        out = mesh.to_host(self.gen.decode(student, tokens, seg, pos, self.stop, key, self.sampling, self.max_new)[0])
        stops = np.asarray(self.stop)[out]
        lengths = np.where(stops.any(1), stops.argmax(1) + 1, self.max_new)  # through the stop token
        answer = (np.arange(self.max_new)[None] < lengths[:, None]).astype(np.int32)
        tokens, seg, pos = np.asarray(tokens), np.asarray(seg), np.asarray(pos)
        batch = {
            "tokens": np.concatenate([tokens, out * answer], 1),
            "segment_ids": np.concatenate([seg, answer], 1),
            "positions": np.concatenate([pos, pos[:, -1:] + 1 + np.arange(self.max_new)[None]], 1),
            "loss_mask": np.concatenate([np.zeros_like(tokens), answer], 1),
        }
        batch[SAMPLED] = np.ones_like(batch["tokens"])
        # Every process samples the same answers (same prompts, same key) and trains on its share.
        return {k: mesh.mine(v) for k, v in batch.items()}, {"on_policy/answer_tokens": float(lengths.mean())}

    def get_state(self) -> dict[str, Any]:
        return {"data": self.data.get_state(), "step": self.step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.data.set_state(state["data"])
        self.step = state["step"]


def distill_objective(cfg: Any, control: bool) -> dict[str, Any]:
    """The train loop's keywords for a distillation run (`cfg`: the distill section): only the
    student trains, on the distillation loss (or, for the control, its own next-token loss),
    and val/loss is always the student's own next-token loss."""
    loss = student_lm_loss if control else distill_loss(cfg.alpha, cfg.temperature, cfg.kl)
    return {"trainable": STUDENT, "loss_fn": loss, "eval_loss_fn": student_lm_loss}
