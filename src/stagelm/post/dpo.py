"""DPO: preference optimisation on pairs of answers to one prompt, a chosen and a rejected one.

The loss of a pair (Rafailov et al. 2023) compares the policy's log-probabilities of the two
answers with the reference's (the parent model, frozen; its log-probabilities are computed
once per pair, when the pair is drawn):

    margin = (log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected))
    sigmoid: −log σ(β · margin)          ipo: (margin − 1/(2β))²

each log-probability summed over the answer's tokens; IPO (Azar et al. 2023) takes their
means over the tokens instead, as TRL does. `nll_weight` adds that weight times the chosen
answer's mean next-token loss (RPO, Pang et al. 2024), which keeps the chosen answer's own
likelihood from falling while the margin grows. β · margin is the pair's reward margin, and
a pair is ranked right when it is positive.

The pairs (`PairSource`, the train loop's batch source) are either a user's
(`data.pref_files`, TRL's format, read by the download stage) or the model's own:
`dpo.samples` answers to each of `dpo.prompts` rl prompts, graded by the family's checker, a
right answer chosen over a wrong one of the same prompt (prompts whose answers all agree
give none). With `dpo.rounds` > 1 each round draws fresh pairs from the current policy
(iterative DPO), against the same reference.
"""

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stagelm.data.chatformat import ChatFormat
from stagelm.data.rawdata import read_raw
from stagelm.infer.generate import BUCKET, Generator, Sampling
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json
from stagelm.infra.memory import require_memory
from stagelm.infra.mesh import mine, to_host
from stagelm.model.footprint import generation_bytes
from stagelm.pipeline.config import DpoConfig
from stagelm.post.grpo import token_logprobs
from stagelm.post.rollouts import answer_ends, graded_length, stream_indices
from stagelm.tasks import check_answer, one_line
from stagelm.train.step import LossFn, next_token_targets

ROW_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference: token ids of the prompt (ready for the answer) and of the two answers."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def at_fork(pair: Pair) -> Pair:
    """The pair where its answers part: their shared first tokens joined to the prompt, each answer cut
    to its first token of its own (the step that goes wrong, as Step-DPO prefers one step given the
    right ones before it, Lai et al. 2024). An answer that is a prefix of the other is left empty: it ended
    where the other went on, and its side of the margin is 0."""
    shared = 0
    while shared < min(len(pair.chosen), len(pair.rejected)) and pair.chosen[shared] == pair.rejected[shared]:
        shared += 1
    prompt = pair.prompt + pair.chosen[:shared]
    return Pair(prompt, pair.chosen[shared : shared + 1], pair.rejected[shared : shared + 1])


def both_rows(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The chosen rows then the rejected rows of a batch of pairs, as one batch of rows."""
    return {k: jnp.concatenate([batch[k], batch[f"rejected_{k}"]]) for k in ROW_KEYS}


def answer_logps(model: nnx.Module, rows: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
    """(sum of the answer tokens' log-probs, their count), per row."""
    inputs, targets, weights = next_token_targets(rows)
    logits = model(inputs["tokens"], inputs["segment_ids"], inputs["positions"], rng)
    return jnp.sum(token_logprobs(logits, targets) * weights, -1), jnp.sum(weights, -1)


def dpo_loss(kind: str, beta: float, nll_weight: float = 0.0) -> LossFn:
    """The pairs' loss (`kind` sigmoid or ipo) summed over the batch's pairs, their count, and
    sums of what is logged per pair: reward margin, accuracy, chosen and rejected rewards and
    log-probs (the train loop divides each by the count)."""

    def loss(model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array | None) -> tuple:
        logp, count = answer_logps(model, both_rows(batch), rng)
        n = batch["tokens"].shape[0]
        ref = batch["ref_logp"]  # (pairs, 2): the reference's sums for chosen, rejected
        count = jnp.maximum(count, 1.0)
        pc, pr, cc, cr = logp[:n], logp[n:], count[:n], count[n:]
        chosen, rejected = pc - ref[:, 0], pr - ref[:, 1]  # the implicit rewards, over β
        if kind == "ipo":
            margin = chosen / cc - rejected / cr
            per_pair = (margin - 1 / (2 * beta)) ** 2
        else:
            margin = chosen - rejected
            per_pair = -jax.nn.log_sigmoid(beta * margin)
        if nll_weight:
            per_pair += nll_weight * (-pc / cc)
        aux = {
            "reward_margin": jnp.sum(beta * margin),
            "reward_accuracy": jnp.sum((margin > 0).astype(jnp.float32)),
            "chosen_reward": jnp.sum(beta * chosen),
            "rejected_reward": jnp.sum(beta * rejected),
            "chosen_logp": jnp.sum(pc),
            "rejected_logp": jnp.sum(pr),
        }
        return jnp.sum(per_pair), jnp.asarray(n, jnp.float32), aux

    return loss


def pair_width(pairs: list[Pair], capacity: int) -> int:
    """The row width that holds every pair's prompt and longer answer, plus the target column, in
    steps of BUCKET (so a round compiles one shape)."""
    longest = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs) + 1
    if longest - 1 > capacity:
        raise StagelmError(
            f"dpo: a pair's prompt and answer take {longest - 1} tokens, beyond the model's context of {capacity}; "
            "shorten the pairs or lower dpo.max_new_tokens"
        )
    return -(-longest // BUCKET) * BUCKET


def pair_rows(pairs: list[Pair], width: int) -> dict[str, np.ndarray]:
    """Right-padded rows of `width`: the chosen ones under ROW_KEYS, the rejected under rejected_*;
    the loss mask is 1 on the answer's tokens."""
    out = {}
    for side, prefix in (("chosen", ""), ("rejected", "rejected_")):
        rows = {k: np.zeros((len(pairs), width), np.int32) for k in ROW_KEYS}
        for i, pair in enumerate(pairs):
            answer = getattr(pair, side)
            n = len(pair.prompt) + len(answer)
            rows["tokens"][i, :n] = pair.prompt + answer
            rows["segment_ids"][i, :n] = 1
            rows["positions"][i, :n] = np.arange(n)
            rows["loss_mask"][i, len(pair.prompt) : n] = 1
        out |= {prefix + k: v for k, v in rows.items()}
    return out


def pref_table(raw: Path) -> list[dict[str, Any]]:
    """The download stage's `pref` rows (data.pref_files), or one line saying to set it."""
    if "pref" not in read_json(raw / "manifest.json")["files"]:
        raise StagelmError(
            "dpo.pairs: files needs data.pref_files (jsonl of prompt, chosen, rejected); set it, or dpo.pairs: self"
        )
    return read_raw(raw, "pref").to_pylist()


def file_pairs(chat: ChatFormat, table: list[dict[str, Any]]) -> list[Pair]:
    """The pairs of the download stage's `pref` set: each prompt's messages in the model's chat
    format, each answer the assistant turn that follows them (`answer_ids`)."""
    pairs = []
    for row in table:
        messages = json.loads(row["messages"])
        prompt = chat.prompt(messages)
        pairs.append(Pair(prompt, *(answer_ids(chat, messages, prompt, row[side]) for side in ("chosen", "rejected"))))
    return pairs


def answer_ids(chat: ChatFormat, messages: list[dict], prompt: list[int], text: str) -> list[int]:
    """The ids of `text` as the assistant's turn after `messages` (whose ids are `prompt`), through its
    end-of-turn token."""
    ids, mask = chat.conversation([*messages, {"role": "assistant", "content": text}])
    end = max(j for j, m in enumerate(mask) if m) + 1
    if ids[: len(prompt)] != prompt or end <= len(prompt):
        raise StagelmError(
            f"{chat.source}: the chat template's prompt is not a prefix of its conversation, so an answer's "
            "tokens cannot be found; use a template that renders turn by turn"
        )
    return ids[len(prompt) : end]


class PairSource:
    """Batches of preference pairs with the reference's log-probs, for `train.loop.train(batches=...)`.

    `pairs` given (a user's), every step draws from them; else (`tasks`, the rl prompts) each of
    `dpo.rounds` rounds first draws its pairs from the current policy's answers (`draw_pairs`).
    A step's pairs are the next `batch_size × grad_accum` of a seeded permutation of the round's
    pairs per epoch, so a run resumed from a checkpoint trains on what an uninterrupted one would:
    the round's pairs are kept in the checkpoint.
    """

    def __init__(self, cfg: DpoConfig, gen: Generator, graphdef: Any, seed: int, tasks=None, pairs=None):
        self.cfg, self.gen, self.graphdef, self.seed = cfg, gen, graphdef, seed
        self.fixed = pairs  # a user's pairs count whole (TRL's DPO): dpo.span is for the model's own answers
        self.tasks = [t for t in tasks or [] if t["family"] in cfg.families]
        self.specs = [json.loads(t["spec"]) for t in self.tasks]
        self.prompts = [gen.chat.user_prompt(t["chat_prompt"]) for t in self.tasks]
        self.ends_answer = answer_ends(gen.tokenizer)  # where a graded answer ends (GRPO's graded_length)
        if pairs is None and not self.tasks:
            raise StagelmError(f"dpo.families: {list(cfg.families)} has no prompt in the rl set")
        self.steps_per_round = cfg.steps // (1 if pairs is not None else cfg.rounds)
        self.ref = jax.tree.map(jnp.copy, gen.params)  # the parent: the train step donates the policy's buffers
        self.step = 0  # steps served
        self.round = -1  # the round whose pairs are drawn
        self.drawn = 0  # prompts answered so far (their stream is seeded)
        self.pairs: list[Pair] = []
        self.rows: dict[str, np.ndarray] = {}
        self._score = jax.jit(lambda params, rows: answer_logps(nnx.merge(gen.graphdef, params), rows, None)[0])

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        host = {}
        if self.step // self.steps_per_round != self.round:
            self.round = self.step // self.steps_per_round
            host = self.begin_round(nnx.split(nnx.merge(self.graphdef, params, frozen))[1])
        per = self.cfg.batch_size * self.cfg.grad_accum
        start = (self.step - self.round * self.steps_per_round) * per
        chosen = stream_indices([self.seed, self.round], len(self.pairs), start, per)
        self.step += 1
        return {k: mine(v[chosen]) for k, v in self.rows.items()}, host

    def begin_round(self, policy: Any) -> dict[str, float]:
        """Draw the round's pairs (a user's, or the policy's own answers) and lay them out with the
        reference's log-probs; the round's host metrics."""
        metrics = {}
        if self.fixed is not None:
            self.pairs = self.fixed
        else:
            self.pairs, metrics = self.draw_pairs(policy)
        if not self.pairs:
            raise StagelmError(
                f"dpo: round {self.round} drew no pair from {self.cfg.prompts} prompts × {self.cfg.samples} answers "
                "(every prompt's answers all right or all wrong); raise dpo.samples, dpo.prompts or dpo.temperature"
            )
        self.lay_out()
        return {**metrics, "pairs/count": float(len(self.pairs))}

    def lay_out(self) -> None:
        self.rows = pair_rows(self.pairs, pair_width(self.pairs, self.gen.capacity))
        self.rows["ref_logp"] = self.reference_logps(self.rows)

    def reference_logps(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        """(pairs, 2) the reference's summed log-probs of each pair's chosen and rejected answer,
        scored `dpo.sample_rows` rows at a time (the last chunk padded with empty rows)."""
        chunk, n = self.cfg.sample_rows, len(rows["tokens"])
        out = np.zeros((n, 2), np.float32)
        for side, prefix in enumerate(("", "rejected_")):
            for start in range(0, n, chunk):
                part = {k: rows[prefix + k][start : start + chunk] for k in ROW_KEYS}
                got = len(part["tokens"])
                part = {k: jnp.asarray(np.pad(v, ((0, chunk - got), (0, 0)))) for k, v in part.items()}
                out[start : start + got, side] = to_host(self._score(self.ref, part))[:got]
        return out

    def draw_pairs(self, policy: Any) -> tuple[list[Pair], dict[str, float]]:
        """`dpo.samples` answers of the policy to each of the round's `dpo.prompts` prompts, graded, and
        up to `dpo.pairs_per_prompt` pairs of a distinct right and wrong answer from each prompt."""
        cfg = self.cfg
        t0 = time.perf_counter()
        indices = stream_indices([self.seed], len(self.tasks), self.drawn, cfg.prompts)
        self.drawn += cfg.prompts
        answers = self.sample(policy, indices)
        pairs, right, paired, tokens = [], 0, 0, 0
        for g, index in enumerate(indices):
            graded = {True: [], False: []}
            for ids, text in answers[g * cfg.samples : (g + 1) * cfg.samples]:
                ok = check_answer(self.tasks[index]["family"], self.specs[index], text)[1]
                right += ok
                tokens += len(ids)
                if ids not in graded[ok]:
                    graded[ok].append(ids)
            reference = self.tasks[index].get("chat_answer")
            if not graded[True] and graded[False] and cfg.reference_answers and reference:
                user = [{"role": "user", "content": self.tasks[index]["chat_prompt"]}]
                graded[True].append(answer_ids(self.gen.chat, user, self.prompts[index], reference))
            found = list(zip(graded[True], graded[False], strict=False))[: cfg.pairs_per_prompt]
            paired += bool(found)
            pairs += [Pair(self.prompts[index], c, r) for c, r in found]
        if cfg.span == "fork":
            pairs = [at_fork(p) for p in pairs]
        seconds = time.perf_counter() - t0
        return pairs, {
            "pairs/answer_accuracy": right / len(answers),
            "pairs/prompts_paired": paired / len(indices),
            "pairs/samples_seen": float(self.drawn * cfg.samples),
            "perf/sample_tokens_per_sec": tokens / seconds,
        }

    def sample(self, policy: Any, indices: np.ndarray) -> list[tuple[list[int], str]]:
        """(answer ids, text) of `dpo.samples` answers to each prompt of `indices`, sampled `dpo.sample_rows`
        at a time. The ids run through the token that completes the graded answer (GRPO's graded length:
        the checker reads no further, and what a model says after its answer is no part of the preference)."""
        cfg, gen = self.cfg, self.gen
        stop = gen.stop_mask(chat=True, stop_at_newline=one_line(cfg.families))
        key = jax.random.fold_in(jax.random.key(self.seed), self.round)
        prompts = [self.prompts[i] for i in indices for _ in range(cfg.samples)]
        sampling = Sampling(temperature=cfg.temperature)
        out = []
        for c, start in enumerate(range(0, len(prompts), cfg.sample_rows)):
            part = prompts[start : start + cfg.sample_rows]
            tokens, seg, pos = gen.layout(part, cfg.max_new_tokens, batch=cfg.sample_rows)
            c_key = jax.random.fold_in(key, c)
            rows, _ = gen.decode(policy, tokens, seg, pos, stop, c_key, sampling, cfg.max_new_tokens)
            for row in to_host(rows)[: len(part)]:
                done = gen.completion(row, stop)
                stopped = done.finish == "stop"
                ids = done.tokens + ([int(row[len(done.tokens)])] if stopped else [])
                out.append((ids[: graded_length(done.tokens, stopped, self.ends_answer)], done.text))
        return out

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{len(self.fixed):,} of data.pref_files"
        cfg = self.cfg
        return (
            f"self: {cfg.rounds} round(s) of {cfg.prompts} of {len(self.tasks):,} rl prompts of {list(cfg.families)} "
            f"× {cfg.samples} answers at temperature {cfg.temperature}"
        )

    def get_state(self) -> dict[str, Any]:
        own = self.fixed is None
        pairs = [[p.prompt, p.chosen, p.rejected] for p in self.pairs] if own else []
        return {"step": self.step, "round": self.round, "drawn": self.drawn, "pairs": pairs}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step, self.round, self.drawn = state["step"], state["round"], state["drawn"]
        self.pairs = self.fixed if self.fixed is not None else [Pair(*p) for p in state["pairs"]]
        if self.round >= 0:
            self.lay_out()


def require_sampling_memory(source: PairSource, model_cfg: Any) -> None:
    """Refuse, naming dpo.sample_rows, answers sampled together that the memory cannot decode."""
    cfg = source.cfg
    width = max(len(p) for p in source.prompts)
    need = generation_bytes(model_cfg, cfg.sample_rows, width, cfg.max_new_tokens)
    what = f"sampling {cfg.sample_rows} answers of up to {cfg.max_new_tokens} tokens at once"
    require_memory(need, "dpo.sample_rows", what, fix="lower it")


def pair_summary(history: list[dict[str, float]]) -> dict[str, float | None]:
    """What a run learned, for metrics.json: its pairs' reward accuracy and margin over its first and
    last ten logged steps, the pairs it drew and the answers it sampled for them (0 with a user's pairs)."""
    logged = [r for r in history if "train/reward_accuracy" in r]
    summary: dict[str, float | None] = {}
    for name in ("reward_accuracy", "reward_margin"):
        values = [r[f"train/{name}"] for r in logged]
        summary[f"{name}_first10"] = float(np.mean(values[:10]))
        summary[f"{name}_last10"] = float(np.mean(values[-10:]))
    summary["pairs"] = float(sum(r["pairs/count"] for r in history if "pairs/count" in r))
    seen = [r["pairs/samples_seen"] for r in history if "pairs/samples_seen" in r]
    summary["samples"] = seen[-1] if seen else 0.0
    speeds = [r["perf/sample_tokens_per_sec"] for r in history if "perf/sample_tokens_per_sec" in r]
    summary["sample_tokens_per_sec"] = float(np.median(speeds)) if speeds else None
    return summary
