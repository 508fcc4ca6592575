"""The model pretraining starts from: a new decoder of the `model` section's shape, or a checkpoint.

With `model.init_from` (hf:<folder> or gguf:<file>) training starts from that checkpoint
(`stagelm.interop.checkpoint`): its architecture (the model section's sizes are unused) and
its context length, whatever length the packed rows have; the run settings (dtype,
param_dtype, remat, attention, scan_layers) still apply. From scratch, the weights are
drawn from `seed`, after a memory check of the parameters, their gradients and Adam's
moments.
"""

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx

from stagelm.infra.errors import StagelmError
from stagelm.infra.memory import require_memory
from stagelm.interop.checkpoint import checkpoint_source, read_checkpoint
from stagelm.model.attention_kernels import require_kernel
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.model.footprint import param_count, training_state_bytes
from stagelm.pipeline.config import ModelConfig


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
    if source is None:
        n = param_count(manifest["vocab_size"], **cfg.shape(), tie_embeddings=cfg.tie_embeddings)
        what = f"{n:,} parameters with their gradients and Adam's two moments"
        fix = "lower model.d_model, model.n_layers or model.d_ff"
        require_memory(training_state_bytes(n, cfg.param_dtype), "model", what, fix=fix)
        model = Decoder(DecoderConfig(vocab_size=manifest["vocab_size"], **cfg.architecture()), nnx.Rngs(seed))
        return Start(model, manifest["seq_len"], "from scratch", None)
    checkpoint = read_checkpoint(source, vocab_size=manifest["vocab_size"], **cfg.settings())
    if manifest["seq_len"] > checkpoint.context:
        raise StagelmError(
            f"pack.seq_len: {manifest['seq_len']} exceeds {source}'s max_position_embeddings {checkpoint.context}; "
            "lower it"
        )
    origin = f"from {source} (its architecture: the model section's sizes are unused)"
    return Start(checkpoint.model, checkpoint.context, origin, source)
