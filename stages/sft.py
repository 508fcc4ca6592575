"""sft stage: supervised fine-tuning of the pretrained model on chat data, full or LoRA.

    python stages/sft.py --params params.yaml --model runs/pretrain/model --train data/packed/sft \
        --val data/packed/val --out runs/sft --checkpoints runs/.checkpoints/sft

The loss counts only assistant tokens (the packed rows' loss_mask). With
`sft.method: lora` only the adapters train; `<out>/model/` is the merged, ordinary
model and `<out>/adapter/` holds the adapter weights alone.
"""

import argparse
from pathlib import Path

import jax
from flax import nnx

from stagelm.checkpoint import stage_fingerprint
from stagelm.config import load_section, load_seed, read_params, section_dict
from stagelm.distributed import initialize
from stagelm.errors import StagelmError, run_main
from stagelm.files import sha256_file, sha256_tree, write_json
from stagelm.hardware import describe_devices
from stagelm.loader import PackedRows
from stagelm.lora import add_lora, merge_lora, save_adapter
from stagelm.model import count_params
from stagelm.modelio import load_model, read_model_config, read_model_context, save_model
from stagelm.provenance import now, write_provenance
from stagelm.sharding import make_mesh
from stagelm.trainloop import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag in ("--model", "--train", "--val", "--out", "--checkpoints"):
        parser.add_argument(flag, required=True, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args()
    initialize()  # joins jax.distributed when launched as one of several processes
    started = now()
    params = read_params(args.params)
    cfg = load_section(params, "sft")
    mesh_cfg = load_section(params, "mesh")
    seed = load_seed(params)

    rows, val_rows = PackedRows(args.train), PackedRows(args.val)
    base_cfg = read_model_config(args.model)
    if base_cfg.vocab_size < rows.manifest["vocab_size"]:  # an imported checkpoint may have spare rows
        raise StagelmError(
            f"{args.model}: vocab {base_cfg.vocab_size} is smaller than {args.train}'s "
            f"{rows.manifest['vocab_size']}; retrain the model on this tokenizer (`dvc repro`)"
        )
    tokenizer = args.model / "tokenizer.json"
    if sha256_file(tokenizer) != rows.manifest["tokenizer_sha256"]:
        raise StagelmError(f"{args.train}: packed with another tokenizer than {args.model}'s; rerun `dvc repro pack`")

    read = {"sft": section_dict(cfg), "seed": seed}
    inputs = {"model": args.model / "params", "train": args.train / "manifest.json", "val": args.val / "manifest.json"}
    fp = stage_fingerprint(__file__, read, inputs)

    mesh = make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    model = load_model(args.model)
    trainable = nnx.Param
    if cfg.method == "lora":
        model, trainable = add_lora(model, cfg.lora, nnx.Rngs(seed)), nnx.LoRAParam
    n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable)))
    print(f"sft ({cfg.method}): {n_train:,} of {count_params(model):,} params train; fingerprint {fp}", flush=True)
    result = train(
        model,
        cfg.training(),
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
    if jax.process_index() == 0:
        extra = {
            "fingerprint": fp,
            "resumed_from": result.resumed_from,
            "devices": describe_devices(),
            "summary": result.summary,
            "trainable_params": n_train,
        }
        write_provenance(args.out / "provenance.json", "sft", read, inputs, started, extra)
    print(f"sft: done at step {result.summary['step']}: train loss {result.summary['train_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
