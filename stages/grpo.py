"""grpo stage: reinforcement learning of the SFT model on rewards a program computes.

    python stages/grpo.py --params params.yaml --model runs/sft/model --raw data/raw --val data/packed/val \
        --out runs/grpo --checkpoints runs/.checkpoints/grpo

The policy starts from `--model` and the reference is a frozen copy of it. Prompts
are the rl task set's, in chat format, of the families in `grpo.families`; the
rewards are the families' checkers (see stagelm.post.grpo). The anchor rows are the raw
SFT conversations of the other families. With `grpo.method: lora` only adapters
train and `<out>/model/` is the merged model. val/loss is the policy's next-token
loss on the corpus val split: what RL costs the language model.
"""

import jax
import numpy as np
from flax import nnx

from stagelm.data.loader import PackedRows
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator
from stagelm.infra.errors import run_main
from stagelm.infra.files import read_json, write_json
from stagelm.infra.memory import require_memory
from stagelm.model.decoder import count_params
from stagelm.model.footprint import generation_bytes
from stagelm.model.lora import merge_lora, trainable_part
from stagelm.model.modeldir import PARAMS_FILE, load_model, read_model_context, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.post.grpo import Rollouts, grpo_loss, rollout_sets
from stagelm.tasks import require_families
from stagelm.train.checkpoints import stage_fingerprint
from stagelm.train.loop import record_training, start_training, train
from stagelm.train.step import lm_loss


def main() -> None:
    stage, mesh = start_training(__doc__, "model", "raw", "val", "out", "checkpoints")
    args = stage.args
    cfg = load_section(stage.params, "grpo")
    require_families(cfg.families, "grpo.families")
    seed = load_seed(stage.params)

    tokenizer_file = args.model / "tokenizer.json"
    val_rows = PackedRows(args.val)
    val_rows.require_tokenizer(tokenizer_file)
    tasks, anchor = rollout_sets(args.raw, cfg)

    read = {"grpo": section_dict(cfg), "seed": seed}
    inputs = {"model": args.model / PARAMS_FILE, "rl": args.raw / "manifest.json", "val": args.val / "manifest.json"}
    fp = stage_fingerprint(__file__, read, inputs)

    model = load_model(args.model, mesh)  # sharded like training: rollouts run on the same mesh
    # lora: the reference stays the base (adapters start at zero); norms: the gains scale each
    # feature, so training them alone sharpens (or flattens) the policy
    model, trainable = trainable_part(model, cfg.method, cfg.lora, nnx.Rngs(seed), "grpo.lora")
    context = read_model_context(args.model)
    gen = Generator(model, load_tokenizer(tokenizer_file), context)
    rollouts = Rollouts(cfg, gen, nnx.graphdef(model), tasks, seed, anchor)
    rows = cfg.prompts_per_step * cfg.group_size // cfg.grad_accum  # sampled a micro-batch at a time
    what = f"sampling {rows} completions of up to {cfg.max_new_tokens} tokens at once"
    need = generation_bytes(model.cfg, rows, rollouts.prompt_width, cfg.max_new_tokens)
    require_memory(need, "grpo.group_size", what, fix="lower it, grpo.prompts_per_step or raise grpo.grad_accum")

    n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
    print(
        f"grpo ({cfg.method}): {n_train:,} of {count_params(model):,} params train; {len(rollouts.tasks)} rl prompts "
        f"of {list(cfg.families)}, {cfg.prompts_per_step}×{cfg.group_size} samples per rollout; fingerprint {fp}",
        flush=True,
    )
    result = train(
        model,
        cfg,
        None,
        val_rows,
        seed=seed,
        mesh=mesh,
        out_dir=args.out,
        checkpoint_root=args.checkpoints,
        fingerprint=fp,
        loss_fn=grpo_loss(cfg.clip_eps, cfg.kl_coef, cfg.anchor_coef, cfg.clip_eps_high, cfg.objective),
        eval_loss_fn=lm_loss,
        batches=rollouts,
        trainable=trainable,
    )
    final = merge_lora(result.model) if cfg.method == "lora" else result.model
    extra = {"params_count": count_params(final), "context_len": context, "method": cfg.method}
    save_model(args.out / "model", final, tokenizer_file, extra)
    record_training(stage, result, fp, read, inputs, trainable_params=n_train)
    rollouts_logged = [r for r in result.history if "rollout/reward" in r]
    rewards = [r["rollout/reward"] for r in rollouts_logged]
    if jax.process_index() == 0:  # what the run earned, over its first and last ten rollouts, and its samples
        summary = read_json(args.out / "metrics.json")
        for name in ("reward", "accuracy", "entropy"):
            values = [r[f"rollout/{name}"] for r in rollouts_logged]
            summary[f"{name}_first10"] = float(np.mean(values[:10]))
            summary[f"{name}_last10"] = float(np.mean(values[-10:]))
        summary["samples"] = rollouts_logged[-1]["rollout/samples_seen"]
        write_json(args.out / "metrics.json", summary)
    print(f"grpo: done at step {result.summary['step']}: reward {rewards[0]:.3f} → {rewards[-1]:.3f}")


if __name__ == "__main__":
    run_main(main)
