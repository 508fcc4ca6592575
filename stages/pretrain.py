"""pretrain stage: train the decoder from scratch, or on from a checkpoint, on the packed corpus.

    python stages/pretrain.py --params params.yaml --train data/packed/train --val data/packed/val \
        --tokenizer data/tokenizer/tokenizer.json --out runs/pretrain --checkpoints runs/.checkpoints/pretrain

Resumes from the last checkpoint of its fingerprint when one exists (a killed
`dvc repro` continues where it stopped); writes `<out>/model/`, dvclive metrics and
plots, and provenance.json. With `model.init_from` (hf:<folder> or gguf:<file>) training
starts from that checkpoint (its architecture; the model section's sizes are unused), and the
saved model keeps its context length and its tokenizer's chat.json (stagelm.train.pretrain).
"""

import jax

from stagelm.data.loader import PackedRows
from stagelm.infra.devices import peak_flops
from stagelm.infra.errors import run_main
from stagelm.model.decoder import count_params, flops_per_token
from stagelm.model.modeldir import save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.train.loop import train
from stagelm.train.pretrain import starting_model
from stagelm.train.run import record_training, start_training, training_run


def main() -> None:
    stage, mesh = start_training(__doc__, "train", "val", "tokenizer", "out", "checkpoints")
    args = stage.args
    model_cfg = load_section(stage.params, "model")
    tcfg = load_section(stage.params, "training")
    seed = load_seed(stage.params)

    train_rows, val_rows = PackedRows(args.train), PackedRows(args.val)
    train_rows.require_tokenizer(args.tokenizer)
    start = starting_model(model_cfg, train_rows.manifest, seed)
    read = {"model": section_dict(model_cfg), "training": section_dict(tcfg), "seed": seed}
    inputs = {"train": args.train / "manifest.json", "val": args.val / "manifest.json", "tokenizer": args.tokenizer}
    if start.source is not None:
        inputs["init_from"] = start.source
    run = training_run(stage, mesh, seed, read, inputs)

    print(
        f"pretrain: {count_params(start.model):,} params {start.origin}, on {mesh.devices.size} "
        f"{jax.devices()[0].platform} device(s); mesh {dict(mesh.shape)}; fingerprint {run.fingerprint}",
        flush=True,
    )
    cfg, seq_len = start.model.cfg, train_rows.manifest["seq_len"]
    flops = {"flops_per_token": flops_per_token(cfg, seq_len), "peak_flops": peak_flops(cfg.dtype)}
    result = train(start.model, tcfg, train_rows, val_rows, run, **flops)
    extra = {"params_count": count_params(result.model), "context_len": start.context}
    save_model(args.out / "model", result.model, args.tokenizer, extra)
    record_training(stage, run, result)
    s = result.summary
    print(f"pretrain: done at step {s['step']}: train loss {s['train_loss']:.4f}, val loss {s['val_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
