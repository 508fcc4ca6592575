"""A transformers Llama checkpoint folder, read into stagelm: its config, weights and chat spec.

`import_hf` reads a local transformers Llama checkpoint (safetensors only; nothing runs
from it) into a stagelm Decoder, refusing what the decoder lacks (biases, rope scaling,
another activation) with one line naming the field. Both major layouts of config.json
import: transformers 4's top-level `rope_theta` and transformers 5's `rope_parameters`.
"""

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import MAX_JSON_BYTES, read_json_object, read_regular_file, regular_file_size
from stagelm.interop.chat_spec import chat_spec
from stagelm.interop.llama_state import (
    FLOAT_LIMITS,
    LIMITS,
    config_float,
    config_int,
    decoder_from_llama_tensors,
    shown,
)
from stagelm.model.decoder import Decoder, DecoderConfig

# config.json fields stagelm's decoder has one value of: a checkpoint that says otherwise is refused.
FIXED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "pretraining_tp": 1}


# RoPE as stagelm computes it: theta^(-2i/d) on the whole head, positions as they are. transformers
# 4 spells it `rope_theta` and `rope_scaling: null`; transformers 5 `rope_parameters: {rope_type:
# "default", rope_theta}`. Every other rope type (linear, dynamic, yarn, longrope, llama3) scales
# positions or frequencies stagelm does not, so it is refused.
ROPE_KEYS = {"rope_type", "rope_theta", "type", "partial_rotary_factor"}


def hf_int(c: dict[str, Any], field: str, path: Path, default: int | None = None) -> int:
    return config_int(c.get(field, default), field, path, LIMITS[field])


def hf_float(c: dict[str, Any], field: str, path: Path, default: float | None = None) -> float:
    limit = FLOAT_LIMITS[field.rpartition(".")[2]]  # rope_parameters.rope_theta: rope_theta's
    return config_float(c.get(field, default), field, path, limit)


def hf_bool(c: dict[str, Any], field: str, path: Path, default: bool) -> bool:
    value = c.get(field, default)
    if not isinstance(value, bool):
        raise StagelmError(f"{path}: {field} = {value!r}; expected true or false")
    return value


def rope_theta(c: dict[str, Any], path: Path) -> float:
    """The RoPE base of a config.json in either layout, refusing any scaling stagelm does not compute.
    A field the checkpoint has is never replaced by a default: only a config with neither
    `rope_theta` nor `rope_parameters` gets Llama's 10,000, as transformers gives it."""
    params = c.get("rope_parameters")
    scaling = c.get("rope_scaling")
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        if not isinstance(block, dict):
            raise StagelmError(f"{path}: {name} = {block!r}; expected an object or null")
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            raise StagelmError(
                f"{path}: {name} has rope_type {kind!r}; stagelm's RoPE has no scaling (only 'default' imports)"
            )
        extra = sorted(set(block) - ROPE_KEYS)
        if extra:
            raise StagelmError(f"{path}: {name} sets {extra}, which stagelm's RoPE does not implement")
        if block.get("partial_rotary_factor", 1.0) != 1.0:
            raise StagelmError(f"{path}: {name}.partial_rotary_factor {block['partial_rotary_factor']!r} is not 1.0")
    if c.get("partial_rotary_factor", 1.0) != 1.0:  # transformers 4's top-level spelling of the same
        raise StagelmError(f"{path}: partial_rotary_factor {c['partial_rotary_factor']!r} is not 1.0")
    found = {
        "rope_theta": c.get("rope_theta"),
        "rope_parameters.rope_theta": params.get("rope_theta") if isinstance(params, dict) else None,
        "rope_scaling.rope_theta": scaling.get("rope_theta") if isinstance(scaling, dict) else None,
    }
    given = {k: hf_float({k: v}, k, path) for k, v in found.items() if v is not None}
    if len(set(given.values())) > 1:
        raise StagelmError(f"{path}: RoPE bases disagree ({given}); keep one")
    return next(iter(given.values()), 10000.0)


def import_config(hf_dir: Path) -> tuple[DecoderConfig, int]:
    """(stagelm DecoderConfig, context length) of a transformers Llama config.json in transformers 4's
    or 5's layout, or one line why not: every field used is type- and range-checked (llama_state.LIMITS)
    before anything is allocated, and a field stagelm cannot represent is refused, never dropped."""
    path = hf_dir / "config.json"
    c = read_json_object(path, "hf:<dir> must be a local transformers checkpoint directory")
    if c.get("model_type") != "llama":
        raise StagelmError(f"{path}: model_type {c.get('model_type')!r}; stagelm imports 'llama' checkpoints only")
    if c.get("quantization_config") is not None:  # packed or scaled weights: refused by name, not by a tensor
        method = c["quantization_config"].get("quant_method") if isinstance(c["quantization_config"], dict) else None
        raise StagelmError(
            f"{path}: quantization_config ({str(method)[:20]}) is set; stagelm imports unquantized weights: give the "
            "checkpoint in float32, float16 or bfloat16"
        )
    for field, value in FIXED.items():
        if c.get(field, value) != value:
            raise StagelmError(f"{path}: {field} = {c[field]!r} is not supported (stagelm's decoder has {value!r})")
    d, h = hf_int(c, "hidden_size", path), hf_int(c, "num_attention_heads", path)
    k = hf_int(c, "num_key_value_heads", path, default=h)
    if d % h:
        raise StagelmError(f"{path}: num_attention_heads {h} does not divide hidden_size {d}")
    if h % k:
        raise StagelmError(f"{path}: num_key_value_heads {k} does not divide num_attention_heads {h}")
    if (d // h) % 2:
        raise StagelmError(f"{path}: hidden_size / num_attention_heads = {d // h} must be even for RoPE")
    if c.get("head_dim") is not None and hf_int(c, "head_dim", path) != d // h:
        raise StagelmError(f"{path}: head_dim {c['head_dim']!r} differs from hidden_size / num_attention_heads")
    cfg = DecoderConfig(
        vocab_size=hf_int(c, "vocab_size", path),
        d_model=d,
        n_layers=hf_int(c, "num_hidden_layers", path),
        n_heads=h,
        n_kv_heads=k,
        d_ff=hf_int(c, "intermediate_size", path),
        rope_theta=rope_theta(c, path),
        norm_eps=hf_float(c, "rms_norm_eps", path, 1e-6),
        tie_embeddings=hf_bool(c, "tie_word_embeddings", path, False),
        init_std=hf_float(c, "initializer_range", path, 0.02),
    )
    return cfg, hf_int(c, "max_position_embeddings", path, default=2048)


# Tensor dtypes safetensors stores that stagelm reads (numpy's; integers are refused by name later):
# 8-bit floats (F8_E4M3, F8_E5M2) and packed 4- or 6-bit ones are quantizations it does not read.
READABLE_DTYPES = {"F16", "BF16", "F32", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL"}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a file's JSON header
INDEX_FILE = "model.safetensors.index.json"


def safetensors_dtypes(file: Path) -> dict[str, str]:
    """{tensor name: dtype} from a safetensors file's header, read without its data; one line
    naming the file when it is not a regular safetensors file."""
    size = regular_file_size(file, None, "give the checkpoint's own weights")
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise StagelmError(f"{file}: not a readable safetensors file (no valid header); give the checkpoint's own")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            raise StagelmError(f"{file}: not a readable safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise StagelmError(f"{file}: not a readable safetensors file (its header is not a table of tensors)")
    dtypes = {name: str(info.get("dtype")) for name, info in header.items() if name != "__metadata__"}
    for name, dtype in dtypes.items():
        if dtype not in READABLE_DTYPES:
            raise StagelmError(
                f"{file}: tensor {name} is {dtype[:20]}, a dtype stagelm does not import; "
                "give the checkpoint in float32, float16 or bfloat16"
            )
    return dtypes


def weight_files(hf_dir: Path) -> dict[Path, set[str] | None]:
    """The safetensors files to read, each with the tensors model.safetensors.index.json puts in it (None
    without an index: then every ``*.safetensors`` file, none of whose tensors may repeat another's)."""
    index = hf_dir / INDEX_FILE
    if not os.path.lexists(index):
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise StagelmError(f"{hf_dir}: no *.safetensors weights (stagelm never loads pickled .bin files)")
        return dict.fromkeys(files)
    weight_map = read_json_object(index, "give the checkpoint's own index, or remove it").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise StagelmError(f"{index}: weight_map is missing or not an object of tensor → file; give the checkpoint's")
    files: dict[Path, set[str] | None] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise StagelmError(f"{index}: weight_map puts {name} in {str(shard)[:60]!r}, not a .safetensors beside it")
        files.setdefault(hf_dir / shard, set()).add(name)
    for file in files:
        if not os.path.lexists(file):
            raise StagelmError(f"{index}: names {file.name}, which is missing; download the checkpoint's every shard")
    return files


def read_safetensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a transformers checkpoint's safetensors files (never a pickled .bin): the shards
    its model.safetensors.index.json names, each holding what the index says, or every file without one."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    came_from: dict[str, Path] = {}
    for file, named in weight_files(hf_dir).items():
        held = set(safetensors_dtypes(file))
        if named is not None and held != named:
            stray = sorted(named - held) or sorted(held - named)
            where = f"{file.name} lacks" if named - held else f"{file.name} holds, besides what it names,"
            raise StagelmError(f"{hf_dir / INDEX_FILE}: {where} {stray[:2]}; the index and the shards disagree")
        try:
            loaded = load_file(str(file))
        except (SafetensorError, OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            raise StagelmError(f"{file}: not a readable safetensors file ({str(err)[:80]})") from None
        for name in loaded:
            if name in came_from:
                raise StagelmError(
                    f"{file}: tensor {name} is also in {came_from[name].name}; remove the file that does not belong"
                )
            came_from[name] = file
        tensors.update(loaded)
    return tensors


def import_hf(hf_dir: str | Path, vocab_size: int | None = None, **settings: Any) -> tuple[Decoder, int]:
    """(stagelm Decoder, context length) of a local transformers Llama checkpoint (model.safetensors);
    `vocab_size` and `settings` as `decoder_from_llama_tensors` takes them."""
    hf_dir = Path(hf_dir)
    cfg, context = import_config(hf_dir)
    return decoder_from_llama_tensors(cfg, read_safetensors(hf_dir), hf_dir, vocab_size, **settings), context


def hf_token(value: Any, key: str, where: Path) -> str | None:
    """A special token's spelling as tokenizer_config.json writes it: a string, an AddedToken object,
    or null (none); anything else (`eos_token: 42`) is refused, never taken for none."""
    spelled = value.get("content") if isinstance(value, dict) else value
    if value is not None and not (isinstance(spelled, str) and spelled):
        raise StagelmError(f"{where}: {key} = {shown(value)}; expected the token's text (or an AddedToken object)")
    return spelled


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # the ones chat.json records


def special_tokens(hf_dir: Path, config: dict[str, Any], config_path: Path) -> dict[str, tuple[str | None, Path]]:
    """{key: (the token's spelling or None, the file that says so)} for SPECIAL_TOKENS, as transformers
    reads them: tokenizer_config.json's, and, when it has no `added_tokens_decoder` (a checkpoint saved
    before transformers 4.34), special_tokens_map.json's over them; a bad file it reads is refused."""
    tokens = {key: (hf_token(config.get(key), key, config_path), config_path) for key in SPECIAL_TOKENS}
    path = hf_dir / "special_tokens_map.json"
    if "added_tokens_decoder" in config or not os.path.lexists(path):  # transformers does not open it
        return tokens
    legacy = read_json_object(path, "give the checkpoint's own special_tokens_map.json, or none")
    return tokens | {key: (hf_token(legacy[key], key, path), path) for key in SPECIAL_TOKENS if key in legacy}


def optional_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`, {} when there is none; a link to nothing, a pipe or a device is refused."""
    return read_json_object(path, fix) if os.path.lexists(path) else {}


def hf_template(hf_dir: Path, config: dict[str, Any], config_path: Path) -> tuple[str | None, Path]:
    """(the checkpoint's chat template or None, the file it came from): chat_template.jinja when there is one
    (transformers 4.43+ saves it apart), else tokenizer_config.json's, a string or named ones' 'default'."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        if not all(isinstance(t, dict) for t in template):
            raise StagelmError(f"{config_path}: chat_template is a list of something other than named templates")
        named = {t.get("name"): t.get("template") for t in template}
        if template and "default" not in named:  # transformers refuses to choose, and so does stagelm
            raise StagelmError(
                f"{config_path}: chat_template lists named templates {sorted(map(str, named))[:4]} but none named "
                "'default'; name the one to chat with 'default'"
            )
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise StagelmError(f"{config_path}: chat_template is {type(template).__name__}; expected a Jinja string")
    path = hf_dir / "chat_template.jinja"
    if not os.path.lexists(path):
        return template, config_path
    data = read_regular_file(path, MAX_JSON_BYTES, "give the checkpoint's own template, or none")
    try:
        return data.decode(), path
    except UnicodeDecodeError as err:
        raise StagelmError(f"{path}: not UTF-8 text (byte {err.start}); re-encode it as UTF-8") from None


def hf_chat_spec(hf_dir: Path, tok: Any) -> dict[str, Any]:
    """chat.json of a transformers checkpoint (stagelm.data.chatformat), from its tokenizer_config.json (or
    chat_template.jinja), special_tokens_map.json (as `special_tokens` reads it), generation_config.json and
    config.json ids; its template is None when it has none (a base model: text only). Every token named
    must be in `tok`, its own tokenizer."""
    config_path = hf_dir / "tokenizer_config.json"
    config = optional_json(config_path, "give the checkpoint's own tokenizer_config.json, or none")
    template, template_path = hf_template(hf_dir, config, config_path)
    generation = hf_dir / "generation_config.json"
    gen = optional_json(generation, "fix or remove it")
    model = read_json_object(hf_dir / "config.json", "a transformers checkpoint's config.json")

    def token_ids(key: str) -> list[int]:  # generation_config.json's, else config.json's, checked against tok
        where = generation if f"{key}_token_id" in gen else hf_dir / "config.json"
        ids = gen.get(f"{key}_token_id", model.get(f"{key}_token_id"))
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        vocab = tok.get_vocab_size()
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab:
                raise StagelmError(
                    f"{where}: {key}_token_id {repr(i)[:40]} is not a token id of its tokenizer (0 to {vocab - 1})"
                )
        return ids

    tokens = special_tokens(hf_dir, config, config_path)

    def spelled(key: str) -> str | None:
        token, where = tokens[f"{key}_token"]
        if token is not None and tok.token_to_id(token) is None:  # named where it was read
            raise StagelmError(f"{where}: {key}_token {shown(token)} is not a token of its tokenizer.json")
        if token is None:
            ids = token_ids(key)
            token = tok.id_to_token(ids[0]) if ids else None
        return token

    eos = spelled("eos")
    if eos is None:
        raise StagelmError(
            f"{tokens['eos_token'][1]}: no eos_token (nor an eos_token_id in generation_config.json); add one"
        )
    stops = [tok.id_to_token(i) for i in token_ids("eos")]
    return chat_spec(
        tok,
        template_path,
        template=template,
        eos=eos,
        bos=spelled("bos"),
        pad=spelled("pad"),
        unk=spelled("unk"),
        stops=stops,
        add_bos=hf_bool(config, "add_bos_token", config_path, False),
    )
