"""distill stage: a smaller student learns from the frozen SFT model (online distillation).

    python stages/distill.py --params params.yaml --teacher runs/sft/model --corpus data/packed/train \
        --sft data/packed/sft --val data/packed/val --raw data/raw --out runs/distill \
        --checkpoints runs/.checkpoints/distill

The student has the shape `distill.student` (the teacher's tokenizer, RoPE and norms).
With `distill.init: teacher` it starts as the teacher pruned to that shape (its layers
evenly spaced, each MLP's strongest units; stagelm.post.distill.student_from_teacher), with
`scratch` from random weights drawn with `seed`. `distill.data` picks its rows: the
packed corpus, the SFT conversations (assistant tokens only) or both; with
`distill.on_policy` > 0 that share of the steps instead samples the student's answers
to the SFT prompts of `--raw` (the download stage's folder) and trains them toward
the teacher's per-token distribution (stagelm.post.distill.OnPolicyBatches). val/loss is
the student's own next-token loss on the corpus val split.

`--control` trains the same student (shape, init, data, steps, seed) with the teacher's
terms off: its own next-token loss only, as `distill.alpha: 0` would, without running
the teacher, and no on-policy steps (it takes no `--raw`). It is what the teacher's
terms are measured against (the report and the claims compare the two); it reads
neither `distill.alpha`, `distill.temperature` nor `distill.on_policy`.
"""

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from stagelm.data.loader import MixedRows, PackedRows
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator
from stagelm.infra.errors import StagelmError, run_main
from stagelm.model.decoder import Decoder, count_params
from stagelm.model.modeldir import PARAMS_FILE, load_model, read_model_config, read_model_context, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.post.distill import (
    STUDENT,
    Distiller,
    OnPolicyBatches,
    check_prunable,
    distill_loss,
    student_from_teacher,
    student_lm_loss,
    teacher_layers,
)
from stagelm.train.checkpoints import stage_fingerprint
from stagelm.train.loop import PackedBatches, record_training, start_training, train

# The keys the control run does not read, for `stagelm deps` and dvc.yaml.
UNREAD_WITH = {"--control": ["distill.alpha", "distill.temperature", "distill.kl", "distill.on_policy"]}


def main() -> None:
    options = {
        "control": {"action": "store_true", "help": "the teacher's terms off: the control run"},
        "raw": {"type": Path, "help": "the download stage's folder: SFT prompts for on-policy steps"},
    }
    paths = ("teacher", "corpus", "sft", "val", "out", "checkpoints")
    stage, mesh = start_training(__doc__, *paths, options=options)
    args = stage.args
    cfg = load_section(stage.params, "distill")
    if args.control:  # keys it does not read leave its fingerprint (and DVC's params) alone
        stage.name = "distill_control"
        cfg = dataclasses.replace(cfg, alpha=0.0, temperature=1.0, kl="forward", on_policy=0.0)
    if cfg.on_policy > 0 and args.raw is None:
        raise StagelmError(f"distill.on_policy: {cfg.on_policy} samples SFT prompts; pass --raw <download folder>")
    seed = load_seed(stage.params)

    teacher_cfg = read_model_config(args.teacher)
    student = cfg.student
    if student.vocab_size is not None and student.vocab_size != teacher_cfg.vocab_size:
        raise StagelmError(
            f"distill.student.vocab_size: {student.vocab_size} differs from the teacher's {teacher_cfg.vocab_size} "
            f"({args.teacher}); the student shares the teacher's tokenizer, set it to null"
        )
    if cfg.init == "teacher":
        check_prunable(student, teacher_cfg, args.teacher)
    tokenizer = args.teacher / "tokenizer.json"
    splits = {"corpus": [args.corpus], "sft": [args.sft], "both": [args.corpus, args.sft]}[cfg.data]
    packed = [PackedRows(d) for d in splits]
    for rows in packed:
        rows.require_tokenizer(tokenizer)
    rows, val_rows = MixedRows(packed), PackedRows(args.val)

    read = {"distill": section_dict(cfg), "seed": seed, "control": args.control}
    inputs = {"teacher": args.teacher / PARAMS_FILE, "val": args.val / "manifest.json"}
    inputs.update({f"data_{i}": d / "manifest.json" for i, d in enumerate(splits)})
    if cfg.on_policy > 0:
        inputs["raw"] = args.raw / "manifest.json"
    fp = stage_fingerprint(__file__, read, inputs)

    student_cfg = dataclasses.replace(teacher_cfg, **student.shape())
    teacher = load_model(args.teacher)
    if cfg.init == "teacher":
        model = Distiller(student_from_teacher(teacher, student_cfg), teacher)
        layers = teacher_layers(teacher_cfg.n_layers, student_cfg.n_layers)
        init = f"the teacher's layers {layers}, {student_cfg.d_ff} of {teacher_cfg.d_ff} MLP units"
    else:
        model, init = Distiller(Decoder(student_cfg, nnx.Rngs(seed)), teacher), "scratch"
    n_student, n_teacher = count_params(model.student), count_params(model.teacher)
    batches = None
    if cfg.on_policy > 0:
        gen = Generator(model.student, load_tokenizer(tokenizer), read_model_context(args.teacher))
        conversations = read_raw(args.raw, "sft").to_pylist()
        local = cfg.batch_size * cfg.grad_accum
        packed_batches = PackedBatches(rows, local // jax.process_count(), seed)
        batches = OnPolicyBatches(packed_batches, cfg.on_policy, nnx.graphdef(model), gen, conversations, local, seed)
        print(
            f"on-policy steps: {len(batches.prompts)} SFT prompts, answers of up to {batches.max_new} tokens"
            + (f" ({batches.skipped} longer prompts leave no room for one)" if batches.skipped else ""),
            flush=True,
        )
    print(
        f"distill: student {n_student:,} params from teacher {n_teacher:,} (init: {init}); alpha {cfg.alpha}, "
        f"T {cfg.temperature}, {cfg.kl} KL, data {cfg.data}, on-policy share {cfg.on_policy}; fingerprint {fp}",
        flush=True,
    )
    result = train(
        model,
        cfg,
        rows,
        val_rows,
        seed=seed,
        mesh=mesh,
        out_dir=args.out,
        checkpoint_root=args.checkpoints,
        fingerprint=fp,
        trainable=STUDENT,
        loss_fn=student_lm_loss if args.control else distill_loss(cfg.alpha, cfg.temperature, cfg.kl),
        eval_loss_fn=student_lm_loss,
        batches=batches,
    )
    final = result.model.student
    extra = {"params_count": n_student, "context_len": read_model_context(args.teacher), "teacher": str(args.teacher)}
    save_model(args.out / "model", final, tokenizer, extra)
    counts = {"student_params": n_student, "teacher_params": n_teacher}
    record_training(stage, result, fp, read, inputs, control=args.control, **counts)
    s = result.summary
    print(f"distill: done at step {s['step']}: train loss {s['train_loss']:.4f}, student val loss {s['val_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
