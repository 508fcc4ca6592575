"""pretrain stage: train the decoder from scratch, or on from a checkpoint, on the packed corpus.

    python stages/pretrain.py --params params.yaml --train data/packed/train --val data/packed/val \
        --tokenizer data/tokenizer/tokenizer.json --out runs/pretrain --checkpoints runs/.checkpoints/pretrain

Resumes from the last checkpoint of its fingerprint when one exists (a killed
`dvc repro` continues where it stopped); writes `<out>/model/`, dvclive metrics and
plots, and provenance.json. With `model.init_from` (hf:<folder> or gguf:<file>) training
starts from that checkpoint (its architecture; the model section's sizes are unused), and the
saved model keeps its context length and its tokenizer's chat.json.
"""

import jax
from flax import nnx

from stagelm.data.loader import PackedRows
from stagelm.infra.devices import peak_flops
from stagelm.infra.errors import StagelmError, run_main
from stagelm.infra.memory import require_memory
from stagelm.interop.checkpoint import checkpoint_source, read_checkpoint
from stagelm.model.decoder import Decoder, DecoderConfig, count_params, flops_per_token
from stagelm.model.footprint import param_count, training_state_bytes
from stagelm.model.modeldir import save_model
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.train.checkpoints import stage_fingerprint
from stagelm.train.loop import record_training, start_training, train


def main() -> None:
    stage, mesh = start_training(__doc__, "train", "val", "tokenizer", "out", "checkpoints")
    args = stage.args
    model_cfg = load_section(stage.params, "model")
    tcfg = load_section(stage.params, "training")
    seed = load_seed(stage.params)

    train_rows, val_rows = PackedRows(args.train), PackedRows(args.val)
    manifest = train_rows.manifest
    train_rows.require_tokenizer(args.tokenizer)
    read = {"model": section_dict(model_cfg), "training": section_dict(tcfg), "seed": seed}
    inputs = {"train": args.train / "manifest.json", "val": args.val / "manifest.json", "tokenizer": args.tokenizer}
    source = checkpoint_source(model_cfg.init_from)
    context = manifest["seq_len"]
    if source is None:
        n = param_count(manifest["vocab_size"], **model_cfg.shape(), tie_embeddings=model_cfg.tie_embeddings)
        what = f"{n:,} parameters with their gradients and Adam's two moments"
        fix = "lower model.d_model, model.n_layers or model.d_ff"
        require_memory(training_state_bytes(n, model_cfg.param_dtype), "model", what, fix=fix)
        model = Decoder(DecoderConfig(vocab_size=manifest["vocab_size"], **model_cfg.architecture()), nnx.Rngs(seed))
        origin = "from scratch"
    else:
        settings = {k: getattr(model_cfg, k) for k in ("dtype", "param_dtype", "remat")}
        checkpoint = read_checkpoint(source, vocab_size=manifest["vocab_size"], **settings)
        model, context = checkpoint.model, checkpoint.context  # its context stays, whatever rows train
        if manifest["seq_len"] > context:
            raise StagelmError(
                f"pack.seq_len: {manifest['seq_len']} exceeds {source}'s max_position_embeddings {context}; lower it"
            )
        inputs["init_from"] = source
        origin = f"from {source} (its architecture: the model section's sizes are unused)"
    cfg = model.cfg
    fp = stage_fingerprint(__file__, read, inputs)

    print(
        f"pretrain: {count_params(model):,} params {origin}, on {mesh.devices.size} {jax.devices()[0].platform} "
        f"device(s); mesh {dict(mesh.shape)}; fingerprint {fp}",
        flush=True,
    )
    result = train(
        model,
        tcfg,
        train_rows,
        val_rows,
        seed=seed,
        mesh=mesh,
        out_dir=args.out,
        checkpoint_root=args.checkpoints,
        fingerprint=fp,
        flops_per_token=flops_per_token(cfg, manifest["seq_len"]),
        peak_flops=peak_flops(cfg.dtype),
    )
    extra = {"params_count": count_params(result.model), "context_len": context}
    save_model(args.out / "model", result.model, args.tokenizer, extra)
    record_training(stage, result, fp, read, inputs)
    s = result.summary
    print(f"pretrain: done at step {s['step']}: train loss {s['train_loss']:.4f}, val loss {s['val_loss']:.4f}")


if __name__ == "__main__":
    run_main(main)
