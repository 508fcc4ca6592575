"""The model pretraining starts from: a new decoder of the `model` section's shape, or a checkpoint.

With `model.init_from` (hf:<folder> or gguf:<file>) training starts from that checkpoint
(`stagelm.interop.checkpoint`): its architecture (the model section's sizes are unused) and
its context length, whatever length the packed rows have; the run settings (dtype,
param_dtype, remat, attention, scan_layers) still apply. Either way the parameters, their
gradients and Adam's moments are checked against memory first (a checkpoint by its config
alone, before any weight is read); from scratch, the weights are drawn from `seed`.
"""

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx

from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.interop.checkpoint import checkpoint_config, checkpoint_source, read_checkpoint
from stagelm.model.attention_kernels import require_kernel
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.footprint import param_count, training_state_bytes
from stagelm.pipeline.config import ModelConfig, ModelShape


@dataclasses.dataclass
class Start:
    model: Decoder
    context: int  # the context the saved model records: the rows' length, or the checkpoint's own
    origin: str  # said in the stage's first line
    source: Path | None  # the checkpoint, an input of the run; None from scratch


def starting_model(cfg: ModelConfig, manifest: dict[str, Any], seed: int) -> Start:
    """The decoder pretraining starts from, for packed rows described by `manifest` (their vocab and seq_len)."""
    source = checkpoint_source(cfg.init_from)
    require_kernel(cfg.attention, manifest["seq_len"])
    shape, context = (cfg, manifest["seq_len"]) if source is None else checkpoint_config(source)  # no weights read
    if manifest["seq_len"] > context:
        raise StagelmError(
            f"pack.seq_len: {manifest['seq_len']} exceeds {source}'s max_position_embeddings {context}; lower it"
        )
    vocab = manifest["vocab_size"] if source is None else max(manifest["vocab_size"], shape.vocab_size)
    sizes = {f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelShape)}
    n = param_count(vocab, **sizes, tie_embeddings=shape.tie_embeddings)
    what = f"{n:,} parameters with their gradients and Adam's two moments"
    if source is None:
        fix = "lower model.d_model, model.n_layers or model.d_ff"
        require_memory(training_state_bytes(n, cfg.param_dtype), "model", what, fix=fix)
        model = Decoder(DecoderConfig(vocab_size=manifest["vocab_size"], **cfg.architecture()), nnx.Rngs(seed))
        return Start(model, manifest["seq_len"], "from scratch", None)
    fix = "start from a smaller checkpoint, or train on a machine with more memory"
    require_memory(training_state_bytes(n, cfg.param_dtype), "model.init_from", f"{source}: {what}", fix=fix)
    checkpoint = read_checkpoint(source, vocab_size=manifest["vocab_size"], **cfg.settings())
    origin = f"from {source} (its architecture: the model section's sizes are unused)"
    return Start(checkpoint.model, checkpoint.context, origin, source)
