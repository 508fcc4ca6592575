"""eval stage: validation loss, perplexity, bits per byte and task accuracy of one model.

    python stages/eval.py --params params.yaml --model runs/pretrain/model --name pretrain --format best \
        --val data/packed/val --raw data/raw --out runs/eval/pretrain

`--format best` (a base model: the better of completion and chat) or `chat` (a tuned
model) picks which accuracy is the overall `accuracy`.
"""

import json

import jax

from stagelm.data.chatformat import load_chat_format
from stagelm.data.loader import PackedRows
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import BUCKET, Generator
from stagelm.infra.errors import run_main
from stagelm.infra.files import atomic_write_bytes, write_json
from stagelm.infra.memory import require_memory
from stagelm.infra.mesh import make_mesh
from stagelm.measure.evaluation import (
    FORMATS,
    answer_tasks,
    family_accuracy,
    limit_per_family,
    pass_k_metrics,
    task_metrics,
    task_prompts,
    val_metrics,
)
from stagelm.model.footprint import generation_bytes
from stagelm.model.modeldir import load_model, read_model_context
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import start
from stagelm.train.batches import check_batch

# Host memory per generated token of a kept answer: its text (up to 4 characters a token),
# the JSON line written from it, and the ids of its batch while they are decoded.
ANSWER_BYTES_PER_TOKEN = 16


def main() -> None:
    options = {"name": {"required": True}, "format": {"required": True, "choices": ("best", "chat")}}
    stage = start(__doc__, "model", "val", "raw", "out", options=options)
    args = stage.args
    stage.name = f"eval@{args.name}"
    cfg = load_section(stage.params, "eval")
    mesh_cfg = load_section(stage.params, "mesh")

    mesh = make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    check_batch(cfg.batch_size, mesh, "eval.batch_size")
    tok = load_tokenizer(args.model / "tokenizer.json")
    model = load_model(args.model, mesh)
    rows = PackedRows(args.val)
    rows.require_tokenizer(args.model / "tokenizer.json")
    with jax.set_mesh(mesh):
        metrics = val_metrics(model, rows, tok, cfg.batch_size, cfg.max_batches, mesh)
    tasks = limit_per_family(read_raw(args.raw, "eval").to_pylist(), cfg.max_examples)
    context = read_model_context(args.model)
    chat = load_chat_format(tok, args.model)
    longest = max(len(p) for fmt in FORMATS for p in task_prompts(chat, tasks, fmt))
    capacity = max(context, longest + cfg.max_new_tokens)
    if capacity > context:
        print(f"eval@{args.name}: eval prompts need {capacity} positions, beyond the trained context of {context}")
    # The decode loop of one batch, and the answers' text the stage keeps for its predictions:
    # every prompt in both formats, sampled once and pass_k times, up to max_new_tokens each.
    width = -(-longest // BUCKET) * BUCKET
    answers = len(tasks) * (3 + cfg.pass_k)
    need = generation_bytes(model.cfg, cfg.task_batch_size, width, cfg.max_new_tokens)
    need += answers * cfg.max_new_tokens * ANSWER_BYTES_PER_TOKEN
    what = f"generating {answers:,} answers of up to eval.max_new_tokens {cfg.max_new_tokens} tokens"
    require_memory(need, "eval.max_new_tokens", what, fix="lower it or eval.task_batch_size")
    gen = Generator(model, tok, capacity, chat)
    records = [r for fmt in FORMATS for r in answer_tasks(gen, tasks, fmt, cfg.task_batch_size, cfg.max_new_tokens)]
    metrics.update(task_metrics(records, args.format), cache_capacity=capacity, trained_context=context)
    if cfg.sample_temperature > 0:  # what GRPO's rollouts see: one sampled chat answer per prompt
        sampled = answer_tasks(gen, tasks, "chat", cfg.task_batch_size, cfg.max_new_tokens, cfg.sample_temperature)
        metrics["chat_sampled"] = {"temperature": cfg.sample_temperature, **family_accuracy(sampled)}
    if cfg.pass_k:  # k sampled answers per prompt: what sampling more often can reach (pass@k)
        chosen = limit_per_family(tasks, cfg.pass_k_prompts)
        repeated = [t for t in chosen for _ in range(cfg.pass_k)]
        samples = answer_tasks(gen, repeated, "chat", cfg.task_batch_size, cfg.max_new_tokens, cfg.sample_temperature)
        passes = pass_k_metrics(samples, cfg.pass_k)
        metrics["chat_pass_k"] = {"k": cfg.pass_k, "temperature": cfg.sample_temperature, **passes}

    if jax.process_index() == 0:
        write_json(args.out / "metrics.json", metrics)
        lines = "".join(json.dumps(r) + "\n" for r in records)
        atomic_write_bytes(args.out / "predictions.jsonl", lines.encode())
        inputs = {"model": args.model, "val": args.val / "manifest.json", "eval_tasks": args.raw / "eval.parquet"}
        read = {"eval": section_dict(cfg), "format": args.format}
        stage.record(args.out / "provenance.json", read, inputs)
    print(
        f"eval@{args.name}: val loss {metrics['val_loss']:.4f}, bits/byte {metrics['bits_per_byte']:.4f}, "
        f"accuracy {metrics['accuracy']:.3f} ± {metrics['accuracy_se']:.3f} ({metrics['accuracy_format']}; "
        f"completion {metrics['completion']['accuracy']:.3f}, chat {metrics['chat']['accuracy']:.3f})"
    )


if __name__ == "__main__":
    run_main(main)
