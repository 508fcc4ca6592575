"""A trained model on disk: `params.safetensors`, `config.json`, `tokenizer.json`.

This directory is what every model stage writes and what downstream stages, the
eval and `stagelm generate` load. It holds parameters only (no optimizer state),
the resolved decoder config with its vocab size, and a copy of the tokenizer the
model was trained with. config.json records the sha256 of the params file and of the
tokenizer at save time, and a model loads only when both still match: a flipped bit
or a swapped tokenizer.json (same size, ids permuted) is refused in one line, never used.
An imported model may also hold `generation_config.json`: its checkpoint's sampling
defaults (temperature, top_p), which the server uses for a request that gives none.

The params are one safetensors file, tensors named by their path in the model
(`blocks/0/attn/q/w`), so the same weights always give the same bytes: DVC sees an
unchanged model as unchanged and skips what depends on it (Orbax's model format
carries save times and random file names). Process 0 writes it from arrays gathered
across processes; every process loads the whole file and places its own shards of
each array onto the mesh. Training checkpoints (`runs/.checkpoints`) stay Orbax:
sharded, asynchronous, resumable.
"""

import dataclasses
import json
import os
import typing
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from stagelm.data.tokenizer import CHAT_FILE
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import atomic_write_bytes, copy_file, read_json_object, sha256_file, write_json
from stagelm.infra.mesh import param_shardings
from stagelm.model.attention_kernels import require_kernel
from stagelm.model.decoder import Decoder, DecoderConfig
from stagelm.pipeline.config import NON_NEGATIVE, POSITIVE, ModelConfig
from stagelm.pipeline.params import check_value

PARAMS_FILE = "params.safetensors"


def tensor_name(path: tuple) -> str:
    """`blocks/0/attn/q/w` for the key path of a leaf of an nnx.State."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(p for p in parts if p != "value")


def host_arrays(state: Any) -> dict[str, np.ndarray]:
    """Every array of `state` on the host, whole (gathered from all processes when sharded across them)."""
    from jax.experimental import multihost_utils

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        out[tensor_name(path)] = np.asarray(leaf)
    return out


def save_tensors(path: Path, state: Any) -> None:
    """`state`'s arrays as one safetensors file at `path` (all processes call; process 0 writes).
    bfloat16, which numpy's safetensors writer lacks, is stored as its uint16 bits and named
    in the file's metadata."""
    from safetensors.numpy import save

    arrays = host_arrays(state)
    if jax.process_index() != 0:
        return
    bf16 = sorted(n for n, a in arrays.items() if a.dtype == jnp.bfloat16)
    stored = {n: a.view(np.uint16) if n in bf16 else np.ascontiguousarray(a) for n, a in arrays.items()}
    atomic_write_bytes(path, save(stored, metadata={"bfloat16": json.dumps(bf16)}))


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            bf16 = set(json.loads((f.metadata() or {}).get("bfloat16", "[]")))
            names = list(f.keys())  # noqa: SIM118 (a safe_open handle is not iterable)
            return {n: f.get_tensor(n).view(jnp.bfloat16) if n in bf16 else f.get_tensor(n) for n in names}
    except (SafetensorError, OSError, ValueError) as err:
        raise StagelmError(f"{path}: not a readable safetensors file ({err}); rerun the stage that wrote it") from None


# How one device runs the model, never part of it: a model trained with splash attention on a TPU
# loads on a CPU (its `auto` takes the reference kernel there).
DEVICE_SETTINGS = ("attention", "splash_tuning", "scan_layers")


def save_model(
    out_dir: str | Path,
    model: Decoder,
    tokenizer: str | Path | Tokenizer,
    extra: dict[str, Any] | None = None,
    chat: dict[str, Any] | None = None,
) -> None:
    """Write params, config.json, the tokenizer (a tokenizer.json file, or a Tokenizer) and its chat
    format into `out_dir` (every process takes part). The chat format is `chat` (chat.json's
    contents), else the chat.json beside a tokenizer file (so a model derived from an imported one
    keeps its template); none for stagelm's own. config.json, written last, holds the hashes
    `load_model` checks."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(out_dir / PARAMS_FILE, nnx.state(model, nnx.Param))
    if jax.process_index() != 0:
        return
    if isinstance(tokenizer, Tokenizer):
        atomic_write_bytes(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True).encode())
    else:
        copy_file(tokenizer, out_dir / "tokenizer.json")
        beside = Path(tokenizer).parent / CHAT_FILE
        if chat is None and beside.is_file() and beside.resolve() != (out_dir / CHAT_FILE).resolve():
            copy_file(beside, out_dir / CHAT_FILE)
    if chat is not None:
        write_json(out_dir / CHAT_FILE, chat)
    tokenizer_sha = sha256_file(out_dir / "tokenizer.json")
    hashes = {"params_sha256": sha256_file(out_dir / PARAMS_FILE), "tokenizer_sha256": tokenizer_sha}
    described = {k: v for k, v in model.cfg.__dict__.items() if k not in DEVICE_SETTINGS}
    write_json(out_dir / "config.json", {**described, **hashes, **(extra or {})})


# config.json's fields are checked by params.yaml's rules for the same keys (`ModelConfig`'s: so
# `rope_theta: -1` is refused here as in params.yaml), and these for the fields it lacks.
FIELD_CHECKS = {
    **{f.name: f.metadata.get("check") for f in dataclasses.fields(ModelConfig) if f.metadata.get("check")},
    "vocab_size": POSITIVE,
    "lora_rank": NON_NEGATIVE,
    "lora_alpha": NON_NEGATIVE,
    "lora_dropout": (lambda v: 0 <= v < 1, "a {type} in [0, 1)"),
}


def model_config_json(model_dir: str | Path) -> dict[str, Any]:
    if Path(model_dir).exists() and not Path(model_dir).is_dir():
        raise StagelmError(f"{model_dir}: a file, not a model folder; give the folder (e.g. runs/sft/model)")
    return read_json_object(
        Path(model_dir) / "config.json", f"{model_dir} is not a stagelm model directory (rerun the stage that wrote it)"
    )


def read_model_config(model_dir: str | Path) -> DecoderConfig:
    """The DecoderConfig of config.json, every field type- and range-checked (one line naming the field)."""
    path = Path(model_dir) / "config.json"
    raw = model_config_json(model_dir)
    if "d_model" not in raw and ("model_type" in raw or "architectures" in raw):  # transformers' own config
        raise StagelmError(
            f"{model_dir}: a transformers checkpoint, not a stagelm model folder; import it first "
            f"(`stagelm import-hf {model_dir} <folder>`) and give that folder"
        )
    hints = typing.get_type_hints(DecoderConfig)
    values = {}
    for field in dataclasses.fields(DecoderConfig):
        if field.name not in raw:
            if field.default is dataclasses.MISSING:
                raise StagelmError(f"{path}: {field.name} missing; not a stagelm model config (rerun its stage)")
            continue
        hint = list[str] if field.name == "lora_targets" else hints[field.name]
        check = FIELD_CHECKS.get(field.name)
        values[field.name] = check_value(raw[field.name], hint, f"{path}: {field.name}", check)
    cfg = DecoderConfig(**values)
    try:
        cfg.validate("model")
    except StagelmError as err:
        raise StagelmError(f"{path}: {err}") from None
    return cfg


def read_model_context(model_dir: str | Path) -> int:
    """The context length the model was trained with (the KV cache size generation uses by default)."""
    path = Path(model_dir) / "config.json"
    return check_value(model_config_json(model_dir).get("context_len"), int, f"{path}: context_len", POSITIVE)


GENERATION_FILE = "generation_config.json"  # optional: the model's sampling defaults, as transformers names them
SAMPLING_RANGES = {"temperature": (0.0, 2.0, "[0, 2]"), "top_p": (0.0, 1.0, "(0, 1]")}


def sampling_defaults(generation: dict[str, Any], where: Path) -> dict[str, float]:
    """The sampling defaults (temperature, top_p) a transformers generation_config.json holds, as
    vLLM reads them (do_sample aside), each checked against the range the server accepts."""
    out = {}
    for key, (low, high, shown_range) in SAMPLING_RANGES.items():
        value = generation.get(key)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high
        if not ok or key == "top_p" and value == 0:
            raise StagelmError(f"{where}: {key} {str(value)[:40]} is not in {shown_range}; fix or remove it")
        out[key] = float(value)
    return out


def read_sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The model directory's sampling defaults (its generation_config.json; none without one)."""
    path = Path(model_dir) / GENERATION_FILE
    if not path.is_file():
        return {}
    return sampling_defaults(read_json_object(path, "fix or remove it"), path)


def verify_model_files(model_dir: Path) -> None:
    """Refuse a model whose params or tokenizer differ from the sha256 config.json recorded at save time."""
    raw = model_config_json(model_dir)
    for name, key in ((PARAMS_FILE, "params_sha256"), ("tokenizer.json", "tokenizer_sha256")):
        path = model_dir / name
        if os.path.lexists(path) and not path.is_file():  # a folder, a pipe, a device or a dangling link
            raise StagelmError(f"{path}: not a regular file; {restore_advice(model_dir)}")
        if not path.is_file():
            raise StagelmError(f"{path}: missing; {restore_advice(model_dir)}")
        if not isinstance(raw.get(key), str):
            raise StagelmError(
                f"{model_dir / 'config.json'}: no {key}, so {name} cannot be verified; rerun the stage that wrote it"
            )
        if sha256_file(path) != raw[key]:
            raise StagelmError(
                f"{path}: sha256 differs from config.json's {key} (changed or damaged since it was saved); "
                f"{restore_advice(model_dir, damaged=True)}"
            )


def restore_advice(model_dir: Path, damaged: bool = False) -> str:
    """What to do about a model folder's missing or damaged file: where the folder is a stage's
    output (runs/<stage>/model), that stage's rerun; elsewhere, the command that wrote it."""
    if model_dir.name == "model" and model_dir.parent.parent.name == "runs":
        stage = model_dir.parent.name
        # Not `dvc checkout --force` for damaged bytes: with a link cache it restores the same bytes.
        how = f"`dvc repro -f {stage}`" if damaged else f"`dvc checkout --force {model_dir}` or `dvc repro -f {stage}`"
        return f"rebuild it with {how}"
    return "write the folder again with the command that made it (a stage, import-hf or import-gguf)"


def run_settings(model: ModelConfig) -> dict[str, Any]:
    """How a training stage computes with a model folder it reads: params.yaml's `model.attention`,
    `model.remat` and `model.scan_layers` (config.json keeps no device setting, and its remat is
    the setting of the run that wrote it)."""
    return {"attention": model.attention, "remat": model.remat, "scan_layers": model.scan_layers}


def load_model(
    model_dir: str | Path, mesh: jax.sharding.Mesh | None = None, settings: dict[str, Any] | None = None
) -> Decoder:
    """The Decoder saved in `model_dir`, its params sharded over `mesh` by their logical axes when
    given, computing with `settings` (`run_settings`) where given."""
    model_dir = Path(model_dir).resolve()
    cfg = dataclasses.replace(read_model_config(model_dir), **(settings or {}))
    if settings:  # a training stage: splash off a TPU is refused in one line, as pretrain refuses it
        require_kernel(cfg.attention, read_model_context(model_dir))
    verify_model_files(model_dir)
    params_file = model_dir / PARAMS_FILE
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    tensors = load_tensors(params_file)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    # Without a mesh: uncommitted arrays on this process's default device, which a later
    # device_put may place on any mesh, across processes too (a committed array may not).
    shardings = jax.tree.leaves(param_shardings(state, mesh)) if mesh is not None else [None] * len(leaves)
    names = [tensor_name(path) for path, _ in leaves]
    if sorted(names) != sorted(tensors):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise StagelmError(
            f"{params_file}: does not match config.json (missing {missing[:3]}, unexpected {extra[:3]}); "
            "rerun its stage"
        )
    arrays = []
    for name, (_, want), sharding in zip(names, leaves, shardings, strict=True):
        have = tensors[name]
        if have.shape != want.shape or have.dtype != want.dtype:
            raise StagelmError(
                f"{params_file}: {name} is {have.dtype}{list(have.shape)}, config.json says "
                f"{want.dtype}{list(want.shape)}; rerun its stage"
            )
        if sharding is None:
            arrays.append(jnp.asarray(have))
        else:
            arrays.append(jax.make_array_from_callback(have.shape, sharding, lambda index, a=have: a[index]))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, arrays), rest)
