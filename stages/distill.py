"""distill stage: a smaller student learns from the frozen SFT model (online distillation).

    python stages/distill.py --params params.yaml --teacher runs/sft/model --corpus data/packed/train \
        --sft data/packed/sft --val data/packed/val --raw data/raw --out runs/distill \
        --checkpoints runs/.checkpoints/distill

The student (`distill.student`, pruned from the teacher or from scratch: stagelm.post.student)
learns on `distill.data`'s rows, on `distill.on_policy` of the steps on its own answers to
the SFT prompts of `--raw`, and on `distill.sequence` of them on the teacher's answers to those
prompts (stagelm.post.distill); val/loss is its own next-token loss.
`--control` trains the same student with the teacher's terms off (no `--raw`): what
distillation is measured against. It reads none of the keys in UNREAD_WITH.
"""

from pathlib import Path

from stagelm.data.loader import PackedRows
from stagelm.infra.errors import run_main
from stagelm.model.decoder import count_params
from stagelm.model.modeldir import PARAMS_FILE, read_model_config, read_model_context, run_settings, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.post.distill import distill_objective
from stagelm.post.student import (
    as_control,
    check_student,
    distill_line,
    distill_rows,
    distill_splits,
    generated_steps,
    make_distiller,
    on_policy_batches,
)
from stagelm.train.loop import train
from stagelm.train.run import record_training, start_training, training_run

# The keys the control run does not read, for `stagelm deps` and dvc.yaml.
UNREAD_WITH = {"--control": ["distill.alpha", "distill.temperature", "distill.kl", "distill.on_policy",
                             "distill.sequence", "distill.sequence_temperature"]}  # fmt: skip


def main() -> None:
    options = {
        "control": {"action": "store_true", "help": "the teacher's terms off: the control run"},
        "raw": {"type": Path, "help": "the download stage's folder: SFT prompts for on-policy steps"},
    }
    stage, mesh = start_training(__doc__, "teacher", "corpus", "sft", "val", "out", "checkpoints", options=options)
    args = stage.args
    cfg = load_section(stage.params, "distill")
    if args.control:  # keys it does not read leave its fingerprint (and DVC's params) alone
        stage.name, cfg = "distill_control", as_control(cfg)
    generated = generated_steps(cfg, args.raw)  # steps on answers to the SFT prompts
    seed = load_seed(stage.params)

    check_student(cfg, read_model_config(args.teacher), args.teacher)
    splits = distill_splits(cfg, args.corpus, args.sft)
    rows, val_rows = distill_rows(splits, args.teacher / "tokenizer.json"), PackedRows(args.val)
    settings = run_settings(load_section(stage.params, "model"))  # model.attention, remat, scan_layers
    read = {"distill": section_dict(cfg), "seed": seed, "control": args.control, "model": settings}
    inputs = {"teacher": args.teacher / PARAMS_FILE, "val": args.val / "manifest.json"}
    inputs |= {f"data_{i}": d / "manifest.json" for i, d in enumerate(splits)}
    inputs |= {"raw": args.raw / "manifest.json"} if generated else {}
    run = training_run(stage, mesh, seed, read, inputs)

    model, init = make_distiller(cfg, args.teacher, seed, settings)
    batches = on_policy_batches(cfg, model, rows, args.teacher, args.raw, seed) if generated else None
    n_student, n_teacher = count_params(model.student), count_params(model.teacher)
    print(f"{distill_line(cfg, n_student, n_teacher, init)}; fingerprint {run.fingerprint}", flush=True)
    result = train(model, cfg, rows, val_rows, run, batches=batches, **distill_objective(cfg, args.control))
    extra = {"params_count": n_student, "context_len": read_model_context(args.teacher), "teacher": str(args.teacher)}
    save_model(args.out / "model", result.model.student, args.teacher / "tokenizer.json", extra)
    record_training(stage, run, result, control=args.control, student_params=n_student, teacher_params=n_teacher)
    s = result.summary
    print(f"distill: done at step {s['step']}: train loss {s['train_loss']:.4f}, student val loss {s['val_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
