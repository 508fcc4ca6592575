"""A trained model on disk: `<dir>/params/` (Orbax), `config.json`, `tokenizer.json`.

This directory is what every model stage writes and what downstream stages, the
eval and `stagelm generate` load. It holds parameters only (no optimizer state),
the resolved decoder config with its vocab size, and a copy of the tokenizer the
model was trained with (its sha256 is in config.json).
"""

import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from stagelm.errors import StagelmError
from stagelm.files import read_json, sha256_file, write_json
from stagelm.model import Decoder, DecoderConfig
from stagelm.sharding import param_shardings


def save_model(
    out_dir: str | Path, model: Decoder, tokenizer_file: str | Path, extra: dict[str, Any] | None = None
) -> None:
    """Write params, config.json and the tokenizer into `out_dir` (every process takes part)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    params = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out_dir / "params", params, force=True)
    if jax.process_index() == 0:
        shutil.copyfile(tokenizer_file, out_dir / "tokenizer.json")
        config = {**model.cfg.__dict__, "tokenizer_sha256": sha256_file(tokenizer_file), **(extra or {})}
        write_json(out_dir / "config.json", config)


def read_model_config(model_dir: str | Path) -> DecoderConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise StagelmError(f"{path}: missing; {model_dir} is not a stagelm model directory (run its stage)")
    return DecoderConfig.from_dict(read_json(path))


def read_model_context(model_dir: str | Path) -> int:
    """The context length the model was trained with (the KV cache size generation uses by default)."""
    return int(read_json(Path(model_dir) / "config.json")["context_len"])


def load_model(model_dir: str | Path, mesh: jax.sharding.Mesh | None = None) -> Decoder:
    """The Decoder saved in `model_dir`, its params sharded over `mesh` by their logical axes when given."""
    model_dir = Path(model_dir).resolve()
    cfg = read_model_config(model_dir)
    if not (model_dir / "params").is_dir():
        raise StagelmError(f"{model_dir / 'params'}: missing; rerun the stage that writes {model_dir}")
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    # Explicit target shardings: the saved ones name the devices of the run that wrote the
    # model (a cluster's, perhaps), which this process may not have.
    if mesh is not None:
        shardings = param_shardings(state, mesh)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, state)
    target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s), state, shardings)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(model_dir / "params", target)
    except (ValueError, KeyError) as err:
        raise StagelmError(
            f"{model_dir / 'params'}: does not match config.json ({str(err)[:120]}); rerun its stage"
        ) from None
    return nnx.merge(graphdef, restored)
