"""LoRA for the decoder: attach adapters to a trained model, merge them back, save them.

Adapters are `nnx.LoRA` modules (x·A·B, B starting at zero, output scaled by
alpha / rank) on the projections named in `sft.lora.targets`; their parameters are
`nnx.LoRAParam`, so `nnx.split(model, nnx.LoRAParam, ...)` separates what trains from
the frozen base weights. `merge_lora` folds each adapter into its weight
(W + alpha/rank · A·B) and returns an ordinary decoder that loads like any other.
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import write_json
from stagelm.model.decoder import Decoder, Projection
from stagelm.pipeline.config import LoraConfig


def projections(model: nnx.Module) -> list[tuple[tuple, Projection]]:
    """(path, module) of every projection of `model`, in graph order."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Projection)]


def check_rank(model: Decoder, lora: LoraConfig, key: str) -> None:
    """Fail naming the key when the rank exceeds a targeted projection's smaller side."""
    for _, projection in projections(model.blocks[0]):
        shape, in_dims = projection.w.shape, projection.in_dims
        width = min(math.prod(shape[:in_dims]), math.prod(shape[in_dims:]))
        if projection.target in lora.targets and lora.rank > width:
            raise StagelmError(
                f"{key}.rank: {lora.rank} exceeds the width {width} of projection {projection.target!r}; lower it"
            )


# The RMSNorm gains of a decoder (each block's two and the final one): a Variable filter.
NORMS = nnx.All(nnx.Param, lambda path, _: str(path[-1]).endswith("norm"))


def trainable_part(model: Decoder, method: str, lora: LoraConfig, rngs: nnx.Rngs, key: str) -> tuple[Decoder, Any]:
    """The model a `method` trains and the filter of its trainable Variables: full, every Param;
    lora, adapters added on `lora.targets` (a copy, its output unchanged); norms, the RMSNorm gains."""
    if method == "lora":
        return add_lora(model, lora, rngs, key), nnx.LoRAParam
    return model, NORMS if method == "norms" else nnx.Param


def add_lora(base: Decoder, lora: LoraConfig, rngs: nnx.Rngs, key: str = "sft.lora") -> Decoder:
    """A copy of `base` with LoRA adapters on `lora.targets` (the model's output is unchanged: B = 0).

    `key` names the params section the settings came from, for the error a bad rank gets.
    """
    check_rank(base, lora, key)
    cfg = dataclasses.replace(
        base.cfg,
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        lora_targets=tuple(lora.targets),
    )
    model = Decoder(cfg, rngs)
    nnx.update(model, nnx.state(base, nnx.Param))
    return model


def merge_lora(model: Decoder) -> Decoder:
    """An ordinary decoder whose weights are W + alpha/rank · A·B for every adapted projection."""
    merged = nnx.eval_shape(lambda: Decoder(model.cfg.without_lora(), nnx.Rngs(0)))
    graphdef, state = nnx.split(merged)
    weights = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    scale = model.cfg.lora_alpha / model.cfg.lora_rank
    for path, projection in projections(model):
        if projection.lora is None:
            continue
        node = weights
        for key in path:
            node = node[key]
        w = node["w"]
        delta = (projection.lora.lora_a[...] @ projection.lora.lora_b[...]).reshape(w.shape) * scale
        node["w"] = (w + delta).astype(w.dtype)
    nnx.replace_by_pure_dict(state, drop_adapters(weights))
    return nnx.merge(graphdef, state)


def drop_adapters(tree: dict) -> dict:
    return {k: drop_adapters(v) if isinstance(v, dict) else v for k, v in tree.items() if k != "lora"}


def save_adapter(out_dir: str | Path, model: Decoder, lora: LoraConfig, base_sha256: str) -> None:
    """Only the adapter weights (`adapter.safetensors`, tensors named by model path) and
    adapter_config.json (rank, alpha, targets, base model hash): same weights, same bytes."""
    from stagelm.model.modeldir import save_tensors

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(out_dir / "adapter.safetensors", nnx.state(model, nnx.LoRAParam))
    if jax.process_index() == 0:
        write_json(
            out_dir / "adapter_config.json",
            {
                "method": "lora",
                **dataclasses.asdict(lora),
                "targets": list(lora.targets),
                "base_model_sha256": base_sha256,
            },
        )
