"""sft stage: supervised fine-tuning of the pretrained model on chat data, full or LoRA.

    python stages/sft.py --params params.yaml --model runs/pretrain/model --train data/packed/sft \
        --corpus data/packed/train --val data/packed/val --out runs/sft --checkpoints runs/.checkpoints/sft

The loss counts only assistant tokens; with `sft.replay` above 0 that share of the rows
are rows of the pretraining corpus (`--corpus`). With `sft.method: lora` only the adapters
train; `<out>/model/` is the merged, ordinary model and `<out>/adapter/` holds the adapter
weights alone (stagelm.post.sft).
"""

import jax
from flax import nnx

from stagelm.data.loader import PackedRows
from stagelm.infra.errors import run_main
from stagelm.model.decoder import count_params
from stagelm.model.lora import trainable_part
from stagelm.model.modeldir import PARAMS_FILE, load_model, read_model_context, run_settings, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.post.sft import finish_sft, sft_rows
from stagelm.train.loop import train
from stagelm.train.run import record_training, start_training, training_run


def main() -> None:
    stage, mesh = start_training(__doc__, "model", "train", "corpus", "val", "out", "checkpoints")
    args = stage.args
    cfg = load_section(stage.params, "sft")
    seed = load_seed(stage.params)

    rows, val_rows = sft_rows(cfg, args.train, args.corpus, args.model), PackedRows(args.val)
    settings = run_settings(load_section(stage.params, "model"))  # model.attention, remat, scan_layers
    read = {"sft": section_dict(cfg), "seed": seed, "model": settings}
    inputs = {"model": args.model / PARAMS_FILE, "train": args.train / "manifest.json"}
    inputs |= {"val": args.val / "manifest.json", **({"corpus": args.corpus / "manifest.json"} if cfg.replay else {})}
    run = training_run(stage, mesh, seed, read, inputs)

    model = load_model(args.model, mesh, settings)  # sharded as training places it, in every process
    model, trainable = trainable_part(model, cfg.method, cfg.lora, nnx.Rngs(seed), "sft.lora")
    n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
    print(
        f"sft ({cfg.method}): {n_train:,} of {count_params(model):,} params train; fingerprint {run.fingerprint}",
        flush=True,
    )
    result = train(model, cfg, rows, val_rows, run, trainable=trainable)

    final = finish_sft(result.model, cfg, args.out / "adapter", inputs["model"])
    extra = {"params_count": count_params(final), "context_len": read_model_context(args.model), "method": cfg.method}
    save_model(args.out / "model", final, args.model / "tokenizer.json", extra)
    record_training(stage, run, result, trainable_params=n_train)
    print(f"sft: done at step {result.summary['step']}: train loss {result.summary['train_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
