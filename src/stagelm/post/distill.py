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

With `distill.sequence` > 0 that share of the steps trains on the teacher's own answers to
the SFT prompts (sequence-level KD; Kim & Rush, 2016), generated once at the start at
`distill.sequence_temperature` (0: greedy), as labels, with the full loss above.

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
from stagelm.tasks import one_line
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
    """Steps on generated answers to SFT prompts; the rest from `data` (the packed rows). A
    `train.batches.BatchSource`; its state is both parts'.

    `share` of the steps are the student's own answers, sampled with its current weights and
    scored by the teacher alone (on-policy distillation). `sequence` of the steps are the
    teacher's own answers (sequence-level KD; Kim & Rush, 2016, "Sequence-Level Knowledge
    Distillation"): each usable prompt answered once, at the start, by the frozen teacher at
    `sequence_sampling` (greedy at temperature 0), and trained on as labels with the full
    distillation loss (the soft term on top: their word-level KD on the teacher's sequences)."""

    def __init__(
        self,
        data: BatchSource,
        share: float,
        graphdef: Any,
        gen: Generator,
        conversations: list[dict],
        rows: int,
        seed: int,
        sequence: float = 0.0,
        teacher: Generator | None = None,
        sequence_sampling: Sampling | None = None,
    ):
        self.data, self.share, self.graphdef, self.gen, self.rows, self.seed = data, share, graphdef, gen, rows, seed
        self.sequence = sequence
        chat = gen.chat
        # Each conversation's opening through its first user turn, ready for the assistant's answer.
        prompts = [chat.prompt(first_turn(c["messages"])) for c in conversations]
        # Room for the longest reference answer (and its end token): the answers the student should give.
        self.max_new = max(sum(chat.conversation(c["messages"])[1]) for c in conversations) + 1
        # Prompts that leave that room in the context (a prompt that does not is no use: its answer would be cut).
        self.prompts = [p for p in prompts if len(p) + self.max_new <= gen.capacity]
        if len(self.prompts) < rows:
            key = "distill.on_policy" if share else "distill.sequence"
            raise StagelmError(
                f"{key}: {len(self.prompts)} of {len(prompts)} SFT prompts leave room for a "
                f"{self.max_new}-token answer in the context of {gen.capacity}, fewer than the {rows} rows of "
                f"a step; raise pack.seq_len or set {key} to 0"
            )
        self.skipped = len(prompts) - len(self.prompts)
        self.stop = gen.stop_mask(chat=True, stop_at_newline=one_line({c["family"] for c in conversations}))
        self.sampling = Sampling(temperature=1.0)
        self.step = 0
        self.answers = self.teacher_answers(teacher, sequence_sampling or Sampling()) if sequence > 0 else None

    def decode(self, gen: Generator, state: Any, chosen: np.ndarray, key: jax.Array, sampling: Sampling) -> tuple:
        """(prompt tokens, segment ids, positions, answers, their lengths through the stop token) of
        prompts `chosen`, answered by `gen`'s model with the weights `state`."""
        tokens, seg, pos = gen.layout([self.prompts[i] for i in chosen], self.max_new)
        out = mesh.to_host(gen.decode(state, tokens, seg, pos, self.stop, key, sampling, self.max_new)[0])
        stops = np.asarray(self.stop)[out]
        lengths = np.where(stops.any(1), stops.argmax(1) + 1, self.max_new)  # through the stop token
        return np.asarray(tokens), np.asarray(seg), np.asarray(pos), out, lengths

    def teacher_answers(self, teacher: Generator, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
        """Every usable prompt's answer by the teacher (`teacher`, its generator), in batches of a step's rows."""
        outs, lengths = [], []
        for start in range(0, len(self.prompts), self.rows):
            chosen = np.arange(start, min(start + self.rows, len(self.prompts)))
            key = jax.random.fold_in(jax.random.key(self.seed + 1), start)  # apart from the on-policy keys
            *_, out, length = self.decode(teacher, teacher.params, chosen, key, sampling)
            outs.append(out)
            lengths.append(length)
        return np.concatenate(outs), np.concatenate(lengths)

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        self.step += 1
        generated = self.share + self.sequence
        if not on_policy_step(self.step, generated):
            return self.data.next(params, frozen)
        chosen = np.random.default_rng([self.seed, self.step]).choice(len(self.prompts), self.rows, replace=False)
        # The generated steps, in turn: the teacher's answers on sequence / (share + sequence) of them.
        teachers = bool(self.sequence) and on_policy_step(int(self.step * generated), self.sequence / generated)
        if teachers:
            tokens, seg, pos = (np.asarray(a) for a in self.gen.layout([self.prompts[i] for i in chosen], self.max_new))
            out, lengths = self.answers[0][chosen], self.answers[1][chosen]
        else:
            student = nnx.state(nnx.merge(self.graphdef, params, frozen).student)
            key = jax.random.fold_in(jax.random.key(self.seed), self.step)
            tokens, seg, pos, out, lengths = self.decode(self.gen, student, chosen, key, self.sampling)
        answer = (np.arange(self.max_new)[None] < lengths[:, None]).astype(np.int32)
        batch = {
            "tokens": np.concatenate([tokens, out * answer], 1),
            "segment_ids": np.concatenate([seg, answer], 1),
            "positions": np.concatenate([pos, pos[:, -1:] + 1 + np.arange(self.max_new)[None]], 1),
            "loss_mask": np.concatenate([np.zeros_like(tokens), answer], 1),
        }
        if not teachers:  # the student's sampled tokens are no labels: the teacher's distribution alone
            batch[SAMPLED] = np.ones_like(batch["tokens"])
        name = "sequence/answer_tokens" if teachers else "on_policy/answer_tokens"
        # Every process builds the same rows (same prompts, same key) and trains on its share.
        return {k: mesh.mine(v) for k, v in batch.items()}, {name: float(lengths.mean())}

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
