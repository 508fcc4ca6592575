"""Evaluate a model: validation loss, perplexity, bits per byte, and task accuracy.

Task accuracy is measured by greedy generation on the held-out `eval` task set, in
both formats a task has (`completion`, as the corpus writes it, and `chat`), and
checked by each family's program (`stagelm.tasks.check_answer`). Each accuracy comes
with its standard error sqrt(p(1-p)/n). `accuracy` overall is the `completion` or
`chat` figure, per the rule the caller passes: "best" (a base model: the better of
the two formats) or "chat" (a tuned model).
"""

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from stagelm.data.chatformat import ChatFormat
from stagelm.data.loader import PackedRows
from stagelm.infer.generate import BUCKET, Generator, Sampling
from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.model.footprint import generation_bytes
from stagelm.pipeline.config import EvalConfig, temperature_key
from stagelm.tasks import check_answer, one_line
from stagelm.train.batches import sum_over_split
from stagelm.train.step import lm_loss, next_token_targets

FORMATS = ("completion", "chat")


def token_bytes(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (byte-level BPE: one vocab character per byte; specials 0)."""
    sizes = np.array([len(tok.id_to_token(i)) for i in range(tok.get_vocab_size())], np.float32)
    sizes[[i for i, t in tok.get_added_tokens_decoder().items() if t.special]] = 0
    return sizes


def val_metrics(
    model: nnx.Module,
    rows: PackedRows,
    tok: Tokenizer,
    batch_size: int,
    max_batches: int | None,
    mesh: jax.sharding.Mesh,
) -> dict[str, float]:
    """Token-weighted validation loss (nats), perplexity and bits per byte."""
    graphdef, params = nnx.split(model)
    sizes = jnp.asarray(token_bytes(tok))

    @jax.jit
    def sums(params: Any, batch: dict) -> tuple:
        loss, weight = lm_loss(nnx.merge(graphdef, params), batch, None)
        _, targets, weights = next_token_targets(batch)
        return loss, weight, jnp.sum(weights * sizes[targets])

    loss, weight, n_bytes = sum_over_split(lambda b: sums(params, b), rows, batch_size, max_batches, mesh)
    mean = loss / max(weight, 1.0)
    return {
        "val_loss": mean,
        "perplexity": math.exp(mean),
        "bits_per_byte": loss / math.log(2) / max(n_bytes, 1.0),
        "val_tokens": weight,
    }


def limit_per_family(tasks: list[dict], max_examples: int | None) -> list[dict]:
    counts: dict[str, int] = {}
    kept = []
    for task in tasks:
        counts[task["family"]] = counts.get(task["family"], 0) + 1
        if max_examples is None or counts[task["family"]] <= max_examples:
            kept.append(task)
    return kept


def task_prompts(chat: ChatFormat, tasks: list[dict], fmt: str) -> list[list[int]]:
    """The tasks' prompts in format `fmt`: a user turn in the model's chat format, or plain text."""
    if fmt == "chat":
        return [chat.user_prompt(t["chat_prompt"]) for t in tasks]
    return [chat.text(t["prompt"]) for t in tasks]


def answer_tasks(
    gen: Generator, tasks: list[dict], fmt: str, batch: int, max_new: int, temperature: float = 0.0
) -> list[dict]:
    """Answers to `tasks` in format `fmt`, each graded: one prediction record per task. Greedy
    by default; sampled at `temperature` (no top-k or top-p cut) from a key fixed per batch."""
    prompts = task_prompts(gen.chat, tasks, fmt)
    sampling = Sampling(temperature=temperature)
    records = []
    for start in range(0, len(tasks), batch):
        chunk = prompts[start : start + batch]
        key = jax.random.fold_in(jax.random.key(0), start)
        newline = one_line({t["family"] for t in tasks[start : start + batch]})  # a worked solution runs on
        chat = fmt == "chat"
        completions = gen.generate(chunk, max_new, sampling, key, chat=chat, stop_at_newline=newline, batch=batch)
        for task, completion in zip(tasks[start : start + batch], completions, strict=True):
            well_formed, correct = check_answer(task["family"], json.loads(task["spec"]), completion.text)
            records.append(
                {
                    "family": task["family"],
                    "format": fmt,
                    "prompt": task["chat_prompt"] if fmt == "chat" else task["prompt"],
                    "completion": completion.text,
                    "well_formed": well_formed,
                    "correct": correct,
                }
            )
    return records


def accuracy_of(records: list[dict]) -> dict[str, float]:
    n = len(records)
    p = sum(r["correct"] for r in records) / n
    well_formed = sum(r["well_formed"] for r in records) / n
    return {"accuracy": p, "accuracy_se": math.sqrt(p * (1 - p) / n), "well_formed": well_formed, "n": n}


def family_accuracy(records: list[dict]) -> dict[str, Any]:
    """Pooled accuracy of `records` and each family's, by name."""
    families = sorted({r["family"] for r in records})
    return {**accuracy_of(records), **{f: accuracy_of([r for r in records if r["family"] == f]) for f in families}}


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from `correct` of `n` samples (Chen et al., 2021):
    1 − C(n − c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct one."""
    return 1.0 if n - correct < k else 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_k_metrics(records: list[dict], samples: int) -> dict[str, Any]:
    """pass@1 and pass@`samples`, pooled and per family, of records holding `samples` consecutive
    answers per prompt; each with the standard error of its mean over prompts."""

    def summary(prompts: list[list[dict]]) -> dict[str, float]:
        out: dict[str, float] = {"n": len(prompts)}
        for k in sorted({1, samples}):
            scores = np.array([pass_at_k(samples, sum(r["correct"] for r in p), k) for p in prompts])
            out[f"pass_at_{k}"] = float(scores.mean())
            out[f"pass_at_{k}_se"] = float(scores.std() / math.sqrt(len(scores)))
        return out

    prompts = [records[i : i + samples] for i in range(0, len(records), samples)]
    families = sorted({p[0]["family"] for p in prompts})
    return {**summary(prompts), **{f: summary([p for p in prompts if p[0]["family"] == f]) for f in families}}


def task_metrics(records: list[dict], rule: str) -> dict[str, Any]:
    """Per format (pooled and per family) accuracy, and the overall `accuracy` by `rule` (best | chat)."""
    out: dict[str, Any] = {fmt: family_accuracy([r for r in records if r["format"] == fmt]) for fmt in FORMATS}
    chosen = max(FORMATS, key=lambda f: out[f]["accuracy"]) if rule == "best" else "chat"
    out.update(accuracy=out[chosen]["accuracy"], accuracy_se=out[chosen]["accuracy_se"], accuracy_format=chosen)
    return out


# Host memory per generated token of a kept answer: its text (up to 4 characters a token),
# the JSON line written from it, and the ids of its batch while they are decoded.
ANSWER_BYTES_PER_TOKEN = 16
CONTEXT_STRETCH = 2  # eval answers may run to twice the trained context, no further


def generation_capacity(chat: ChatFormat, tasks: list[dict], context: int, max_new: int) -> tuple[int, int]:
    """(KV-cache positions the eval prompts need with `max_new` answer tokens, at least the trained
    context; the longest prompt in either format, in tokens)."""
    longest = max(len(p) for fmt in FORMATS for p in task_prompts(chat, tasks, fmt))
    return max(context, longest + max_new), longest


def require_eval_memory(model_cfg: Any, cfg: EvalConfig, tasks: list[dict], longest: int) -> None:
    """Refuse, naming eval.max_new_tokens, answers the memory cannot hold: the decode loop of one
    batch, and the answers' text the stage keeps for its predictions (every prompt in both
    formats, sampled once and pass_k times, up to max_new_tokens each)."""
    width = -(-longest // BUCKET) * BUCKET
    answers = len(tasks) * (3 + cfg.pass_k)
    need = generation_bytes(model_cfg, cfg.task_batch_size, width, cfg.max_new_tokens)
    need += answers * cfg.max_new_tokens * ANSWER_BYTES_PER_TOKEN
    what = f"generating {answers:,} answers of up to eval.max_new_tokens {cfg.max_new_tokens} tokens"
    require_memory(need, "eval.max_new_tokens", what, fix="lower it or eval.task_batch_size")


def lm_eval_metrics(model_dir: Path, cfg: EvalConfig, inputs: Path) -> dict[str, Any]:
    """{"lm_eval": lm-eval's figures by task} of the tasks `eval.lm_eval_tasks` names (task YAMLs
    under `inputs`), or {} when it names none: lm-eval, an optional extra, is imported only then."""
    if not cfg.lm_eval_tasks:
        return {}
    from stagelm.measure.harness import evaluate_tasks

    return {"lm_eval": evaluate_tasks(model_dir, cfg.lm_eval_tasks, cfg.lm_eval_limit, inputs, cfg.batch_size)}


def best_temperature(by_temperature: dict[str, dict]) -> float:
    """The temperature of `chat_temperatures` whose pooled accuracy is highest (the first of a tie)."""
    best = max(by_temperature.values(), key=lambda v: v["accuracy"])
    return float(best["temperature"])


def require_eval_context(cfg: EvalConfig, longest: int, context: int) -> None:
    """Refuse answers that run past twice the model's trained context: positions it never saw,
    whose decoding (one compiled loop, deaf to signals while it runs) can take hours."""
    if longest + cfg.max_new_tokens > CONTEXT_STRETCH * context:
        raise StagelmError(
            f"eval.max_new_tokens: {cfg.max_new_tokens} plus the longest eval prompt ({longest} tokens) passes "
            f"{CONTEXT_STRETCH}× the model's trained context of {context} positions; lower it to at most "
            f"{max(CONTEXT_STRETCH * context - longest, 1)}"
        )


def sampled_metrics(gen: Generator, tasks: list[dict], cfg: EvalConfig) -> dict[str, Any]:
    """The sampled chat answers' metrics: `chat_sampled` (one answer per prompt at
    eval.sample_temperature, what GRPO's rollouts see), `chat_temperatures` (one answer per prompt
    at each of eval.temperatures, keyed by the temperature as a string, laid out as chat_sampled;
    `chat_best_temperature` the one that scores best, the first of a tie) and `chat_pass_k` (k
    answers per prompt: what sampling more often can reach). A temperature is a baseline: what a
    model gains by sampling differently comes for free, with no training."""
    out: dict[str, Any] = {}
    sampled: list[dict] = []
    if cfg.sample_temperature > 0:
        sampled = answer_tasks(gen, tasks, "chat", cfg.task_batch_size, cfg.max_new_tokens, cfg.sample_temperature)
        out["chat_sampled"] = {"temperature": cfg.sample_temperature, **family_accuracy(sampled)}
    if cfg.temperatures:
        chosen = limit_per_family(tasks, cfg.temperature_prompts)
        by_temperature = {}
        for t in cfg.temperatures:
            same = sampled and t == cfg.sample_temperature and len(chosen) == len(tasks)  # the same answers
            records = sampled if same else answer_tasks(gen, chosen, "chat", cfg.task_batch_size, cfg.max_new_tokens, t)
            by_temperature[temperature_key(t)] = {"temperature": t, **family_accuracy(records)}
        out["chat_temperatures"] = by_temperature
        out["chat_best_temperature"] = best_temperature(by_temperature)
    if cfg.pass_k:
        chosen = limit_per_family(tasks, cfg.pass_k_prompts)
        repeated = [t for t in chosen for _ in range(cfg.pass_k)]
        samples = answer_tasks(gen, repeated, "chat", cfg.task_batch_size, cfg.max_new_tokens, cfg.sample_temperature)
        passes = pass_k_metrics(samples, cfg.pass_k)
        out["chat_pass_k"] = {"k": cfg.pass_k, "temperature": cfg.sample_temperature, **passes}
    return out
