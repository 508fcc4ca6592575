"""grpo stage: reinforcement learning of the SFT model on rewards a program computes.

    python stages/grpo.py --params params.yaml --model runs/sft/model --raw data/raw --val data/packed/val \
        --out runs/grpo --checkpoints runs/.checkpoints/grpo

The policy starts from `--model` and the reference is a frozen copy of it. Prompts
are the rl task set's, in chat format, of the families in `grpo.families`; the
rewards are the families' checkers (stagelm.post.rollouts, stagelm.post.grpo). The anchor
rows are the raw SFT conversations of the other families. `grpo.method` picks what trains
(lora: `<out>/model/` is the merged model). val/loss is the policy's next-token loss on the
corpus val split: what RL costs the language model.
"""

import jax
from flax import nnx

from stagelm.data.loader import PackedRows
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator
from stagelm.infra.devices import peak_flops
from stagelm.infra.errors import run_main
from stagelm.infra.files import read_json, write_json
from stagelm.model.decoder import count_params
from stagelm.model.lora import merge_lora, trainable_part
from stagelm.model.modeldir import PARAMS_FILE, load_model, read_model_context, run_settings, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.post.grpo import grpo_loss
from stagelm.post.rollouts import Rollouts, require_rollout_memory, rollout_sets, rollout_summary
from stagelm.tasks import require_families
from stagelm.train.loop import train
from stagelm.train.run import record_training, start_training, training_run
from stagelm.train.step import lm_loss


def main() -> None:
    stage, mesh = start_training(__doc__, "model", "raw", "val", "out", "checkpoints")
    args = stage.args
    cfg = load_section(stage.params, "grpo")
    require_families(cfg.families, "grpo.families")
    seed = load_seed(stage.params) if cfg.seed is None else cfg.seed

    tokenizer_file = args.model / "tokenizer.json"
    val_rows = PackedRows(args.val)
    val_rows.require_tokenizer(tokenizer_file)
    tasks, anchor = rollout_sets(args.raw, cfg)
    settings = run_settings(load_section(stage.params, "model"))  # model.attention, remat, scan_layers
    read = {"grpo": section_dict(cfg), "seed": seed, "model": settings}
    inputs = {"model": args.model / PARAMS_FILE, "rl": args.raw / "manifest.json", "val": args.val / "manifest.json"}
    run = training_run(stage, mesh, seed, read, inputs)

    model = load_model(args.model, mesh, settings)  # sharded like training: rollouts run on the same mesh
    model, trainable = trainable_part(model, cfg.method, cfg.lora, nnx.Rngs(seed), "grpo.lora")
    context = read_model_context(args.model)
    gen = Generator(model, load_tokenizer(tokenizer_file), context)
    rollouts = Rollouts(cfg, gen, nnx.graphdef(model), tasks, seed, anchor)
    require_rollout_memory(rollouts, model.cfg, cfg)
    n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
    print(
        f"grpo ({cfg.method}): {n_train:,} of {count_params(model):,} params train; {len(rollouts.tasks)} rl prompts "
        f"of {list(cfg.families)}, {cfg.prompts_per_step}×{cfg.group_size} samples per rollout; "
        f"fingerprint {run.fingerprint}",
        flush=True,
    )
    loss_fn = grpo_loss(cfg.clip_eps, cfg.kl_coef, cfg.anchor_coef, cfg.clip_eps_high, cfg.objective, cfg.entropy_coef)
    result = train(
        model, cfg, None, val_rows, run, loss_fn=loss_fn, eval_loss_fn=lm_loss, batches=rollouts, trainable=trainable
    )
    final = merge_lora(result.model) if cfg.method == "lora" else result.model
    extra = {"params_count": count_params(final), "context_len": context, "method": cfg.method}
    save_model(args.out / "model", final, tokenizer_file, extra)
    record_training(stage, run, result, trainable_params=n_train)
    summary = rollout_summary(result.history, peak_flops(model.cfg.dtype))
    if jax.process_index() == 0:  # what the run earned, over its first and last ten rollouts, and its samples
        write_json(args.out / "metrics.json", {**read_json(args.out / "metrics.json"), **summary})
    s, first, last = result.summary, summary["reward_first10"], summary["reward_last10"]
    print(f"grpo: done at step {s['step']}: mean reward {first:.3f} (first ten rollouts) → {last:.3f} (last ten)")


if __name__ == "__main__":
    run_main(main)
