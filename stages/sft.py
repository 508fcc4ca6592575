"""sft stage: supervised fine-tuning of the pretrained model on chat data, full or LoRA.

    python stages/sft.py --params params.yaml --model runs/pretrain/model --train data/packed/sft \
        --corpus data/packed/train --val data/packed/val --out runs/sft --checkpoints runs/.checkpoints/sft

The loss counts only assistant tokens (the packed rows' loss_mask); with `sft.replay`
above 0 that share of the rows are rows of the pretraining corpus (`--corpus`, every
token counted), so the language model is kept while the chat format is learned. With
`sft.method: lora` only the adapters train; `<out>/model/` is the merged, ordinary
model and `<out>/adapter/` holds the adapter weights alone.
"""

import jax
from flax import nnx

from stagelm.data.loader import MixedRows, PackedRows
from stagelm.infra.errors import StagelmError, run_main
from stagelm.infra.files import sha256_tree, write_json
from stagelm.model.decoder import count_params
from stagelm.model.lora import add_lora, merge_lora, save_adapter
from stagelm.model.modeldir import PARAMS_FILE, load_model, read_model_config, read_model_context, save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.train.checkpoints import stage_fingerprint
from stagelm.train.loop import record_training, start_training, train


def main() -> None:
    stage, mesh = start_training(__doc__, "model", "train", "corpus", "val", "out", "checkpoints")
    args = stage.args
    cfg = load_section(stage.params, "sft")
    seed = load_seed(stage.params)

    rows, val_rows = PackedRows(args.train), PackedRows(args.val)
    base_cfg = read_model_config(args.model)
    if base_cfg.vocab_size < rows.manifest["vocab_size"]:  # an imported checkpoint may have spare rows
        raise StagelmError(
            f"{args.model}: vocab {base_cfg.vocab_size} is smaller than {args.train}'s "
            f"{rows.manifest['vocab_size']}; retrain the model on this tokenizer (`dvc repro`)"
        )
    tokenizer = args.model / "tokenizer.json"
    rows.require_tokenizer(tokenizer)
    if cfg.replay > 0:
        corpus = PackedRows(args.corpus)
        corpus.require_tokenizer(tokenizer)
        wanted = round(len(rows) * cfg.replay / (1 - cfg.replay))
        if wanted > len(corpus):
            raise StagelmError(
                f"sft.replay: {cfg.replay} asks {wanted} corpus rows beside {len(rows)} SFT rows, but "
                f"{args.corpus} holds {len(corpus)}; lower it"
            )
        rows = MixedRows([rows, corpus], [None, wanted])

    read = {"sft": section_dict(cfg), "seed": seed}
    inputs = {
        "model": args.model / PARAMS_FILE,
        "train": args.train / "manifest.json",
        "val": args.val / "manifest.json",
        **({"corpus": args.corpus / "manifest.json"} if cfg.replay > 0 else {}),
    }
    fp = stage_fingerprint(__file__, read, inputs)

    model = load_model(args.model, mesh)  # sharded as training places it, in every process
    trainable = nnx.Param
    if cfg.method == "lora":
        model, trainable = add_lora(model, cfg.lora, nnx.Rngs(seed)), nnx.LoRAParam
    n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
    print(f"sft ({cfg.method}): {n_train:,} of {count_params(model):,} params train; fingerprint {fp}", flush=True)
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
        trainable=trainable,
    )

    final = result.model
    if cfg.method == "lora":
        save_adapter(args.out / "adapter", final, cfg.lora, sha256_tree(inputs["model"]))
        final = merge_lora(final)
    elif jax.process_index() == 0:
        write_json(args.out / "adapter" / "adapter_config.json", {"method": "full"})
    extra = {"params_count": count_params(final), "context_len": read_model_context(args.model), "method": cfg.method}
    save_model(args.out / "model", final, tokenizer, extra)
    record_training(stage, result, fp, read, inputs, trainable_params=n_train)
    print(f"sft: done at step {result.summary['step']}: train loss {result.summary['train_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
