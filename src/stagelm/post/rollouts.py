"""GRPO's rollouts: prompts of the rl task set answered by the current policy, scored by a program.

Each rollout takes `prompts_per_step` prompts of the rl task set, samples `group_size`
completions of each with the KV-cache generator, scores them with the task family's
checker (1 for a correct answer, plus `format_weight` for a well-formed one; partial
credit per right step with `reward: steps`) and lays them out as the train step's batch,
with the group-normalised advantages, the old and the reference log-probs
(`stagelm.post.grpo`). With `dynamic_sampling` (DAPO, Yu et al. 2025) groups whose samples
all scored alike, which teach nothing, make way for more prompts.

`Rollouts` is the train loop's batch source: it samples with the current parameters
and derives each rollout's sampling key and prompts from the seed and the rollout
index, so a run resumed from a checkpoint draws exactly what an uninterrupted run would.
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
from stagelm.infra.memory import require_memory
from stagelm.infra.mesh import mine, to_host
from stagelm.model.decoder import flops_per_token
from stagelm.model.footprint import generation_bytes
from stagelm.pipeline.config import GrpoConfig
from stagelm.post.grpo import group_advantages, token_logprobs
from stagelm.tasks import REGISTRY, check_answer, one_line, step_credit


def rollout_metrics(drawn: list["Group"]) -> dict[str, float]:
    """What a rollout's drawn samples show: reward, binary accuracy, the shares of groups with
    mixed rewards, all right and all wrong, and the entropy of the sampling distribution over
    the tokens that train (it falls as the policy sharpens)."""
    rewards = np.asarray([g.rewards for g in drawn])
    correct = np.asarray([g.correct for g in drawn])
    tokens = sum(sum(g.lengths) for g in drawn)
    return {
        "rollout/reward": float(rewards.mean()),
        "rollout/accuracy": float(correct.mean()),
        "rollout/well_formed": float(np.mean([g.formed for g in drawn])),
        "rollout/completion_tokens": float(np.mean([g.lengths for g in drawn])),
        "rollout/mixed_groups": float(np.mean(np.ptp(rewards, axis=1) > 0)),
        "rollout/all_right_groups": float(np.mean(correct.all(axis=1))),
        "rollout/all_wrong_groups": float(np.mean(~correct.any(axis=1))),
        "rollout/entropy": float(sum(sum(g.entropy) for g in drawn) / max(tokens, 1)),
        "rollout/prompts_drawn": float(len(drawn)),
    }


def graded_length(tokens: list[int], stopped: bool, ends_answer: np.ndarray) -> int:
    """Tokens of a completion that train: through the one that completes the graded answer.

    The checker reads only the first sentence, so later tokens cannot change the reward;
    leaving them out of the loss removes their noise without biasing the gradient. A
    completion that never ends its answer trains on every token, its stop token included.
    """
    ends = np.flatnonzero(ends_answer[np.asarray(tokens, np.int64)]) if tokens else []
    return int(ends[0]) + 1 if len(ends) else len(tokens) + stopped


def answer_ends(tokenizer: Any) -> np.ndarray:
    """(vocab,) whether each token completes a graded answer (its first sentence: up to a period or a newline)."""
    return np.array([any(c in tokenizer.decode([i]) for c in ".\n") for i in range(tokenizer.get_vocab_size())])


def rollout_sets(raw: Path, cfg: GrpoConfig) -> tuple[list[dict], list[dict]]:
    """(rl prompts, anchor conversations) from the download stage's `raw` folder, or one line why
    they cannot serve `cfg`. The anchor: SFT conversations of the families the reward does not target."""
    tasks = read_raw(raw, "rl").to_pylist()
    if not any(t["family"] in cfg.families for t in tasks):
        found = sorted({t["family"] for t in tasks})
        raise StagelmError(f"grpo.families: {list(cfg.families)} has no prompt in {raw}'s rl set (it has {found})")
    anchor = [c for c in read_raw(raw, "sft").to_pylist() if c["family"] not in cfg.families]
    if cfg.anchor_coef > 0 and len(anchor) < cfg.anchor_rows:
        raise StagelmError(
            f"grpo.anchor_coef: {cfg.anchor_coef} needs {cfg.anchor_rows} (grpo.anchor_rows) SFT conversations "
            f"outside grpo.families in {raw}, found {len(anchor)}; set it to 0"
        )
    if cfg.reward == "steps":
        flat = [f for f in cfg.families if REGISTRY[f].step_credit is None]
        if flat:
            raise StagelmError(
                f"grpo.reward: steps needs families whose answers have checkable steps; {flat} have none "
                "(set grpo.reward: outcome or drop them from grpo.families)"
            )
    if cfg.anchor_rows % jax.process_count():
        raise StagelmError(f"grpo.anchor_rows: {cfg.anchor_rows} does not split over {jax.process_count()} processes")
    return tasks, anchor


@dataclasses.dataclass
class Group:
    """The scored samples of one prompt: `rows` (group_size, max_new_tokens) of token ids."""

    index: int  # the prompt's place in the rl set
    rows: np.ndarray
    rewards: list[float]
    correct: list[bool]
    formed: list[bool]
    lengths: list[int]  # tokens that train (graded_length)
    entropy: list[float]  # the sampling distribution's entropy summed over those tokens
    sampled: list[int] = dataclasses.field(default_factory=list)  # tokens generated, through the stop token

    def teaches(self, cfg: GrpoConfig) -> bool:
        """Whether any of the group's samples weighs in the loss (`sample_weights`): for grpo, rewards
        that differ; for rft, a correct sample; with `prompt_weight: unsure`, also a wrong one."""
        return bool(np.any(sample_weights([self], cfg)))


class Rollouts:
    """Batches of scored rollouts of the current policy, for `train.loop.train(batches=...)`."""

    def __init__(
        self,
        cfg: GrpoConfig,
        gen: Generator,
        graphdef: Any,
        tasks: list[dict],
        seed: int,
        anchor: list[dict] | None = None,
    ):
        self.cfg, self.gen, self.graphdef, self.seed = cfg, gen, graphdef, seed
        self.anchor = anchor_set(gen.chat, anchor) if cfg.anchor_coef > 0 else None
        self.tasks = [t for t in tasks if t["family"] in cfg.families]
        self.prompts = [gen.chat.user_prompt(t["chat_prompt"]) for t in self.tasks]
        self.specs = [json.loads(t["spec"]) for t in self.tasks]
        longest = max(len(p) for p in self.prompts)
        self.prompt_width = min(-(-longest // BUCKET) * BUCKET, gen.capacity)  # the widest layout of a rollout
        if longest + cfg.max_new_tokens > gen.capacity:
            raise StagelmError(
                f"grpo.max_new_tokens: {cfg.max_new_tokens} plus the longest rl prompt ({longest} tokens) "
                f"exceed the model's context of {gen.capacity}; lower it"
            )

        self.ends_answer = answer_ends(gen.tokenizer)
        # The reference: a copy of the starting policy (the train step donates the policy's buffers),
        # kept only for a loss that reads it: the KL penalty or the anchor.
        self.ref = jax.tree.map(jnp.copy, gen.params) if cfg.kl_coef > 0 or cfg.anchor_coef > 0 else None
        self.rollout = 0  # rollouts drawn so far
        self.drawn = 0  # prompts drawn so far (their stream is seeded: see prompt_indices)
        self.sampled = 0  # prompts sampled so far: the drawn ones and the revisited ones
        self.unsure: list[int] = []  # the last rollout's unsure prompts, the lowest reward first (grpo.revisit)
        self.update = 0  # updates taken on the current rollout
        self.batch: dict[str, np.ndarray] | None = None
        self.ready_at: float | None = None
        self._score = jax.jit(self._score_fn)

    def _score_fn(self, params: Any, tokens: jax.Array, seg: jax.Array, pos: jax.Array) -> jax.Array:
        """Log-prob of each token given the ones before it: (B, L), 0 in column 0."""
        model = nnx.merge(self.gen.graphdef, params)
        logits = model(tokens[:, :-1], seg[:, :-1], pos[:, :-1])
        return jnp.pad(token_logprobs(logits, tokens[:, 1:]), ((0, 0), (1, 0)))

    def prompt_indices(self, start: int, count: int) -> np.ndarray:
        """Prompts `start` to `start + count` of the stream: a seeded permutation of the set per epoch."""
        return stream_indices([self.seed], len(self.tasks), start, count)

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        if self.update == 0 or self.batch is None:
            host = self.draw(nnx.split(nnx.merge(self.graphdef, params, frozen))[1])
        else:
            self.batch["on_policy"] = np.zeros_like(self.batch["on_policy"])
            host = {}
        batch = dict(self.batch)
        if self.cfg.anchor_coef > 0:
            batch.update(self.anchor_rows(self.rollout - 1, self.update))
        self.update = (self.update + 1) % self.cfg.updates_per_rollout
        # Every process draws the same rollout (same prompts, same keys) and trains on its share of the rows.
        return {k: mine(v) for k, v in batch.items()}, host

    def anchor_rows(self, rollout: int, update: int) -> dict[str, np.ndarray]:
        """This update's anchor rows, drawn by (seed, rollout, update), with the reference's log-probs."""
        rng = np.random.default_rng([self.seed, rollout, update])
        chosen = np.sort(rng.choice(len(self.anchor["tokens"]), self.cfg.anchor_rows, replace=False))
        out = {k: v[chosen] for k, v in self.anchor.items()}
        args = (jnp.asarray(out["tokens"]), jnp.asarray(out["segment_ids"]), jnp.asarray(out["positions"]))
        out["ref_logp"] = to_host(self._score(self.ref, *args))
        return {f"anchor_{k}": v for k, v in out.items()}

    def sample_groups(self, policy: Any, chosen: np.ndarray, key: jax.Array) -> list[Group]:
        """`group_size` scored completions of each prompt in `chosen`, sampled with `policy` in
        `grad_accum` chunks of whole groups (the KV cache holds one chunk's rows at a time)."""
        cfg, gen = self.cfg, self.gen
        stop = gen.stop_mask(chat=True, stop_at_newline=one_line(cfg.families))
        sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p)
        chunks = np.split(chosen, cfg.grad_accum)
        keys = [key] if cfg.grad_accum == 1 else list(jax.random.split(key, cfg.grad_accum))
        groups = []
        for chunk, chunk_key in zip(chunks, keys, strict=True):
            prompts = [self.prompts[i] for i in chunk for _ in range(cfg.group_size)]
            tokens, seg, pos = gen.layout(prompts, cfg.max_new_tokens)
            out, stats = gen.decode(policy, tokens, seg, pos, stop, chunk_key, sampling, cfg.max_new_tokens, True)
            out, entropy = to_host(out), to_host(stats["entropy"])
            for g, i in enumerate(chunk):
                rows = slice(g * cfg.group_size, (g + 1) * cfg.group_size)
                groups.append(self.score(int(i), out[rows], entropy[rows], stop))
        return groups

    def score(self, index: int, rows: np.ndarray, entropy: np.ndarray, stop: jax.Array) -> "Group":
        """The group of prompt `index`'s sampled `rows`: each graded, rewarded and measured."""
        task, spec = self.tasks[index], self.specs[index]
        group = Group(index, rows, [], [], [], [], [])
        for row, row_entropy in zip(rows, entropy, strict=True):
            completion = self.gen.completion(row, stop)
            ok_form, ok = check_answer(task["family"], spec, completion.text)
            if self.cfg.reward == "steps":
                earned = step_credit(task["family"], spec, task["chat_prompt"], completion.text)
            else:
                earned = float(ok)
            length = graded_length(completion.tokens, completion.finish == "stop", self.ends_answer)
            group.rewards.append(earned + self.cfg.format_weight * float(ok_form))
            group.correct.append(ok)
            group.formed.append(ok_form)
            group.lengths.append(length)
            group.sampled.append(len(completion.tokens) + (completion.finish == "stop"))
            group.entropy.append(float(row_entropy[:length].sum()))
        return group

    def draw(self, policy: Any) -> dict[str, float]:
        """Sample, score and lay out one rollout with the current policy; its host metrics.

        With `revisit` > 0 the first batch begins with up to that share of the previous rollout's
        unsure prompts (`unsure_prompts`) and fresh ones fill the rest. With `dynamic_sampling`,
        groups that teach the objective nothing (`Group.teaches`) are set aside and more
        prompts drawn, up to `max_draws` batches, until `prompts_per_step` groups teach; a
        rollout still short fills with set-aside groups. The metrics cover every drawn sample,
        before any group is set aside.
        """
        cfg = self.cfg
        jax.block_until_ready(policy)
        update_s = time.perf_counter() - self.ready_at if self.ready_at is not None else None
        updated = None if self.batch is None else self.batch["tokens"].shape  # the rows the update(s) just trained on
        t0 = time.perf_counter()
        per = cfg.prompts_per_step
        key = jax.random.fold_in(jax.random.key(self.seed), self.rollout)
        kept: list[Group] = []
        alike: list[Group] = []
        drawn: list[Group] = []
        revisited = np.asarray(self.unsure[: int(cfg.revisit * per)], np.int64)
        for draw in range(cfg.max_draws if cfg.dynamic_sampling else 1):
            fresh = per - len(revisited) if draw == 0 else per
            chosen = self.prompt_indices(self.drawn, fresh)
            if draw == 0:
                chosen = np.concatenate([revisited, chosen])
            self.drawn += fresh
            self.sampled += per
            groups = self.sample_groups(policy, chosen, key if draw == 0 else jax.random.fold_in(key, draw))
            drawn += groups
            for group in groups:
                (kept if not cfg.dynamic_sampling or group.teaches(cfg) else alike).append(group)
            if len(kept) >= per:
                break
        groups = (kept + alike)[:per]
        self.unsure = unsure_prompts(drawn)
        rollout_s = time.perf_counter() - t0
        self.batch = self.layout(policy, groups)
        self.rollout += 1
        self.ready_at = time.perf_counter()
        metrics = rollout_metrics(drawn)
        metrics["rollout/samples_seen"] = float(self.sampled * cfg.group_size)  # completions generated so far
        metrics["rollout/prompts_revisited"] = float(len(revisited))
        metrics["perf/rollout_tokens_per_sec"] = float(sum(sum(g.sampled) for g in drawn) / rollout_s)
        if update_s is not None:
            metrics["perf/update_seconds"] = update_s
            tokens_per_sec = updated[0] * updated[1] * cfg.updates_per_rollout / update_s
            metrics["perf/update_tokens_per_sec"] = tokens_per_sec
            metrics["perf/update_flops_per_sec"] = tokens_per_sec * flops_per_token(self.gen.model.cfg, updated[1])
        return metrics

    def layout(self, policy: Any, groups: list[Group]) -> dict[str, np.ndarray]:
        """The training rows of a rollout's groups: prompt and completion tokens, the mask of the
        tokens that train, each row's weight (`sample_weights`) and the log-probs the loss needs."""
        cfg, gen = self.cfg, self.gen
        size, new = cfg.group_size, cfg.max_new_tokens
        prompts = [self.prompts[g.index] for g in groups for _ in range(size)]
        tokens, seg, pos = (np.asarray(a) for a in gen.layout(prompts, new))
        weights = sample_weights(groups, cfg).reshape(-1)
        out = np.concatenate([g.rows for g in groups])
        width = tokens.shape[1]
        lengths = np.asarray([n for g in groups for n in g.lengths])
        gen_mask = (np.arange(new)[None] < lengths[:, None]).astype(np.int32)
        trains = gen_mask * (weights[:, None] != 0) if cfg.objective == "rft" else gen_mask
        full_tokens = np.concatenate([tokens, out * gen_mask], 1)
        full_seg = np.concatenate([seg, np.ones_like(out)], 1)
        full_pos = np.concatenate([pos, pos[:, -1:] + 1 + np.arange(new)[None]], 1)
        batch = {
            "tokens": full_tokens,
            "segment_ids": full_seg,
            "positions": full_pos,
            "completion_mask": np.concatenate([np.zeros_like(tokens), trains], 1),
            "advantages": np.repeat(weights[:, None], width + new, 1).astype(np.float32),
            "on_policy": np.ones(full_tokens.shape, np.float32),
        }
        args = (jnp.asarray(full_tokens), jnp.asarray(full_seg), jnp.asarray(full_pos))
        if cfg.kl_coef > 0:  # only the KL penalty reads the reference's log-probs of the rollout
            batch["ref_logp"] = to_host(self._score(self.ref, *args))
        batch["old_logp"] = (
            to_host(self._score(policy, *args))
            if cfg.updates_per_rollout > 1
            else np.zeros(full_tokens.shape, np.float32)
        )
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "rollout": self.rollout,
            "update": self.update,
            "drawn": self.drawn,
            "sampled": self.sampled,
            "unsure": [int(i) for i in self.unsure],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state["update"] != 0:
            raise StagelmError(
                f"a GRPO checkpoint at update {state['update']} of a rollout: checkpoints fall between "
                "rollouts; delete this run's folder under runs/.checkpoints/grpo/ to start over"
            )
        self.rollout, self.update, self.drawn = state["rollout"], 0, state["drawn"]
        self.sampled, self.unsure = state["sampled"], list(state["unsure"])


def stream_indices(seed: list[int], n: int, start: int, count: int) -> np.ndarray:
    """Items `start` to `start + count` of an endless stream over `n` items: a permutation of them
    per epoch, seeded by `seed` and the epoch, so any stretch of it is drawn without the ones before."""
    epochs = {}
    out = []
    for i in range(start, start + count):
        epoch, offset = divmod(i, n)
        if epoch not in epochs:
            epochs[epoch] = np.random.default_rng([*seed, epoch]).permutation(n)
        out.append(epochs[epoch][offset])
    return np.asarray(out, np.int64)


def anchor_set(chat: ChatFormat, conversations: list[dict]) -> dict[str, np.ndarray]:
    """SFT conversations as (n, width) rows: tokens, segment_ids (0 = padding), positions, loss_mask."""
    encoded = [chat.conversation(c["messages"]) for c in conversations]
    width = max(len(ids) for ids, _ in encoded)
    rows = {k: np.zeros((len(encoded), width), np.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    for i, (ids, mask) in enumerate(encoded):
        n = len(ids)
        rows["tokens"][i, :n], rows["loss_mask"][i, :n] = ids, mask
        rows["segment_ids"][i, :n], rows["positions"][i, :n] = 1, np.arange(n)
    return rows


def unsure_prompts(groups: list[Group]) -> list[int]:
    """The prompts of `groups` whose samples scored differently (with the outcome reward: partly right),
    the lowest mean reward first, then in draw order: where the policy is unsure, which `grpo.revisit`
    samples again."""
    unsure = [g for g in groups if np.ptp(g.rewards) > 0]
    return [g.index for g in sorted(unsure, key=lambda g: float(np.mean(g.rewards)))]


def sample_weights(groups: list["Group"], cfg: GrpoConfig) -> np.ndarray:
    """(groups, group_size) weights of a rollout's samples in the loss.

    grpo: the group advantages (`group_advantages`), the positive ones times
    `positive_weight` and the negative ones times `negative_weight`. rft: 1 for each
    correct sample that trains (every one, or the first of each group with `rft_keep: one`),
    0 for the rest. With `prompt_weight: unsure` each group's weights are then multiplied by
    the share of its samples that are wrong, so the prompts the policy always answers right
    weigh nothing and the ones it mostly misses weigh most, and rescaled so the nonzero
    weights keep their mean size."""
    correct = np.asarray([g.correct for g in groups], np.float32)
    if cfg.objective == "rft":
        weights = correct
        if cfg.rft_keep == "one":
            first = np.argmax(correct, axis=1)
            weights = correct * (np.arange(correct.shape[1])[None] == first[:, None])
    else:
        adv = group_advantages(np.asarray([g.rewards for g in groups], np.float32), cfg.advantages)
        weights = np.where(adv > 0, cfg.positive_weight * adv, cfg.negative_weight * adv)
    if cfg.prompt_weight == "flat":
        return weights
    unsure = weights * (1 - correct.mean(axis=1, keepdims=True))
    return unsure * (mean_size(weights) / mean_size(unsure) if unsure.any() else 0.0)


def mean_size(weights: np.ndarray) -> float:
    """The mean magnitude of the nonzero entries of `weights`."""
    return float(np.abs(weights[weights != 0]).mean())


def require_rollout_memory(rollouts: Rollouts, model_cfg: Any, cfg: GrpoConfig) -> None:
    """Refuse, naming grpo.group_size, a rollout's micro-batch of samples the memory cannot decode."""
    rows = cfg.prompts_per_step * cfg.group_size // cfg.grad_accum  # sampled a micro-batch at a time
    what = f"sampling {rows} completions of up to {cfg.max_new_tokens} tokens at once"
    need = generation_bytes(model_cfg, rows, rollouts.prompt_width, cfg.max_new_tokens)
    require_memory(need, "grpo.group_size", what, fix="lower it, grpo.prompts_per_step or raise grpo.grad_accum")


def rollout_summary(history: list[dict[str, float]], peak: float | None = None) -> dict[str, float | None]:
    """What a run earned, for metrics.json: mean reward, accuracy and entropy over its first and
    last ten rollouts, and the samples it drew; and how fast its two phases ran, medians over the
    rollouts: `rollout_tokens_per_sec` (completion tokens sampled), `update_tokens_per_sec` (the
    rows' tokens the update trained on, from a batch's arrival to the next rollout, so with its
    logging and checkpoints) and `update_mfu` against the device's published `peak` (None where
    none is known, as on a CPU)."""
    logged = [r for r in history if "rollout/reward" in r]
    summary: dict[str, float | None] = {}
    for name in ("reward", "accuracy", "entropy"):
        values = [r[f"rollout/{name}"] for r in logged]
        summary[f"{name}_first10"] = float(np.mean(values[:10]))
        summary[f"{name}_last10"] = float(np.mean(values[-10:]))
    summary["samples"] = logged[-1]["rollout/samples_seen"]

    def median(key: str) -> float | None:
        values = [r[key] for r in history if key in r]
        return float(np.median(values)) if values else None

    summary["rollout_tokens_per_sec"] = median("perf/rollout_tokens_per_sec")
    summary["update_tokens_per_sec"] = median("perf/update_tokens_per_sec")
    flops = median("perf/update_flops_per_sec")
    summary["update_mfu"] = flops / peak if flops is not None and peak else None
    return summary
