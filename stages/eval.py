"""eval stage: val loss, perplexity, bits per byte, task accuracy and lm-eval tasks of one model.

    python stages/eval.py --params params.yaml --model runs/pretrain/model --name pretrain --format best \
        --val data/packed/val --raw data/raw --inputs inputs --out runs/eval/pretrain

`--format best` (a base model: the better of completion and chat) or `chat` (a tuned model) picks
which accuracy is the overall `accuracy` (stagelm.measure.evaluation); `eval.lm_eval_tasks`' figures
go under `lm_eval.<task>` (stagelm.measure.harness), their task YAMLs under `--inputs` (data.inputs).
"""

import json

import jax

from stagelm.data.chatformat import load_chat_format
from stagelm.data.loader import PackedRows
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator
from stagelm.infra.errors import run_main
from stagelm.infra.files import atomic_write_bytes, write_json
from stagelm.infra.mesh import make_mesh
from stagelm.measure.evaluation import (
    FORMATS,
    answer_tasks,
    generation_capacity,
    limit_per_family,
    lm_eval_metrics,
    require_eval_context,
    require_eval_memory,
    sampled_metrics,
    task_metrics,
    val_metrics,
)
from stagelm.model.modeldir import load_model, read_model_context
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import start
from stagelm.train.batches import check_batch


def main() -> None:
    options = {"name": {"required": True}, "format": {"required": True, "choices": ("best", "chat")}}
    stage = start(__doc__, "model", "val", "raw", "inputs", "out", options=options)
    args, stage.name = stage.args, f"eval@{stage.args.name}"
    cfg, mesh_cfg = load_section(stage.params, "eval"), load_section(stage.params, "mesh")

    mesh = make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    check_batch(cfg.batch_size, mesh, "eval.batch_size")
    tok = load_tokenizer(args.model / "tokenizer.json")
    model = load_model(args.model, mesh)
    rows = PackedRows(args.val)
    rows.require_tokenizer(args.model / "tokenizer.json")
    with jax.set_mesh(mesh):
        metrics = val_metrics(model, rows, tok, cfg.batch_size, cfg.max_batches, mesh)
    tasks = limit_per_family(read_raw(args.raw, "eval").to_pylist(), cfg.max_examples)
    context, chat = read_model_context(args.model), load_chat_format(tok, args.model)
    capacity, longest = generation_capacity(chat, tasks, context, cfg.max_new_tokens)
    require_eval_memory(model.cfg, cfg, tasks, longest)
    require_eval_context(cfg, longest, context)
    if capacity > context:
        print(f"eval@{args.name}: eval prompts need {capacity} positions, beyond the trained context of {context}")
    gen = Generator(model, tok, capacity, chat)
    records = [r for fmt in FORMATS for r in answer_tasks(gen, tasks, fmt, cfg.task_batch_size, cfg.max_new_tokens)]
    metrics.update(task_metrics(records, args.format), cache_capacity=capacity, trained_context=context)
    metrics.update(sampled_metrics(gen, tasks, cfg))
    metrics.update(lm_eval_metrics(args.model, cfg, args.inputs))
    if jax.process_index() == 0:
        write_json(args.out / "metrics.json", metrics)
        atomic_write_bytes(args.out / "predictions.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
        inputs = {"model": args.model, "val": args.val / "manifest.json", "eval_tasks": args.raw / "eval.parquet"}
        stage.record(args.out / "provenance.json", {"eval": section_dict(cfg), "format": args.format}, inputs)
    print(
        f"eval@{args.name}: val loss {metrics['val_loss']:.4f}, bits/byte {metrics['bits_per_byte']:.4f}, "
        f"accuracy {metrics['accuracy']:.3f} ± {metrics['accuracy_se']:.3f} ({metrics['accuracy_format']}; "
        f"completion {metrics['completion']['accuracy']:.3f}, chat {metrics['chat']['accuracy']:.3f})"
    )


if __name__ == "__main__":
    run_main(main)
