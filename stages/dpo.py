"""dpo stage: direct preference optimisation of the SFT model, on its own graded answers or a user's pairs.

    python stages/dpo.py --params params.yaml --model runs/sft/model --raw data/raw --val data/packed/val \
        --out runs/dpo --checkpoints runs/.checkpoints/dpo

The policy starts from `--model`, the reference is a frozen copy of it, and the pairs are its own
graded answers (`dpo.pairs: self`) or data.pref_files' (stagelm.post.dpo). `dpo.method` picks what
trains (lora: `<out>/model/` is the merged model). val/loss is the next-token loss on the corpus
val split: what preference tuning costs the language model.
"""

import jax
from flax import nnx

from stagelm.data.chatformat import load_chat_format
from stagelm.data.loader import PackedRows
from stagelm.data.rawdata import read_raw
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infer.generate import Generator
from stagelm.infra.errors import run_main
from stagelm.infra.files import read_json, write_json
from stagelm.model.decoder import count_params
from stagelm.model.lora import merge_lora, trainable_part
from stagelm.model.modeldir import PARAMS_FILE, load_model, read_model_context, run_settings, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.post.dpo import PairSource, dpo_loss, file_pairs, pair_summary, pref_table, require_sampling_memory
from stagelm.tasks import require_families
from stagelm.train.loop import train
from stagelm.train.run import record_training, start_training, training_run
from stagelm.train.step import lm_loss


def main() -> None:
    stage, mesh = start_training(__doc__, "model", "raw", "val", "out", "checkpoints")
    args = stage.args
    cfg = load_section(stage.params, "dpo")
    require_families(cfg.families, "dpo.families")
    seed = load_seed(stage.params) if cfg.seed is None else cfg.seed

    tokenizer_file = args.model / "tokenizer.json"
    val_rows = PackedRows(args.val)
    val_rows.require_tokenizer(tokenizer_file)
    settings = run_settings(load_section(stage.params, "model"))  # model.attention, remat, scan_layers
    read = {"dpo": section_dict(cfg), "seed": seed, "model": settings}
    inputs = {"model": args.model / PARAMS_FILE, "raw": args.raw / "manifest.json", "val": args.val / "manifest.json"}
    run = training_run(stage, mesh, seed, read, inputs)

    model = load_model(args.model, mesh, settings)
    model, trainable = trainable_part(model, cfg.method, cfg.lora, nnx.Rngs(seed), "dpo.lora")
    tokenizer = load_tokenizer(tokenizer_file)
    gen = Generator(model, tokenizer, read_model_context(args.model), load_chat_format(tokenizer, args.model))
    if cfg.pairs == "files":
        source = PairSource(cfg, gen, nnx.graphdef(model), seed, pairs=file_pairs(gen.chat, pref_table(args.raw)))
    else:
        source = PairSource(cfg, gen, nnx.graphdef(model), seed, tasks=read_raw(args.raw, "rl").to_pylist())
        require_sampling_memory(source, model.cfg)
    n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
    print(
        f"dpo ({cfg.method}, {cfg.loss}, β {cfg.beta}): {n_train:,} of {count_params(model):,} params train; pairs "
        f"{source.describe()}; fingerprint {run.fingerprint}",
        flush=True,
    )
    loss_fn = dpo_loss(cfg.loss, cfg.beta, cfg.nll_weight)
    result = train(
        model, cfg, None, val_rows, run, loss_fn=loss_fn, eval_loss_fn=lm_loss, batches=source, trainable=trainable
    )
    final = merge_lora(result.model) if cfg.method == "lora" else result.model
    extra = {"params_count": count_params(final), "context_len": gen.capacity, "method": cfg.method}
    save_model(args.out / "model", final, tokenizer_file, extra)
    record_training(stage, run, result, trainable_params=n_train)
    summary = pair_summary(result.history)
    if jax.process_index() == 0:
        write_json(args.out / "metrics.json", {**read_json(args.out / "metrics.json"), **summary})
    done, ranked = result.summary["step"], summary["reward_accuracy_last10"]
    print(f"dpo: done at step {done}: {summary['pairs']:.0f} pairs; the last ten steps ranked {ranked:.1%} right")


if __name__ == "__main__":
    run_main(main)
