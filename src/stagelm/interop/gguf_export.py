"""A stagelm model written as a llama GGUF file for llama.cpp, through the `gguf` package.

    stagelm export-gguf runs/sft/model runs/sft.gguf [--dtype float16]     # the export@ stages write one too

Matrices in float32, float16 or bfloat16, norms in float32; the tokenizer as llama.cpp's
lists (tokens, types, merges) under its pre-tokenizer's name; the special tokens, the
end-of-turn token and the chat template (the checkpoint's own, or one rendering stagelm's
format). Written to a temporary file and renamed: a failed write leaves nothing half done.
"""

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from stagelm.data.chatformat import load_chat_format
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import file_mode, naming
from stagelm.interop.chat_spec import CHAT_TEMPLATE
from stagelm.interop.gguf_layout import (
    LAYER_NAMES,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    WHOLE_NAMES,
    permute,
)
from stagelm.interop.llama_state import llama_tensors
from stagelm.model.decoder import DecoderConfig
from stagelm.model.modeldir import load_model, read_model_context

DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0")


def vocabulary(tok: Any) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, their llama.cpp types, BPE merges as 'a b') of a byte-level BPE tokenizer."""
    import json

    spec = json.loads(tok.to_str())
    if spec["model"]["type"] != "BPE":
        raise StagelmError(f"the tokenizer is {spec['model']['type']}; GGUF export writes byte-level BPE only")
    size = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(size)]
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    added = set(tok.get_added_tokens_decoder())
    types = [
        TOKEN_CONTROL if i in specials else TOKEN_USER_DEFINED if i in added else TOKEN_NORMAL for i in range(size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


def pre_tokenizer_name(tok: Any) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: smollm (digits, then GPT-2) or gpt2."""
    import json

    pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(s.get("type"), s.get("individual_digits"), s.get("use_regex", True)) for s in steps]
    if kinds == [("Digits", True, True), ("ByteLevel", None, True)]:
        return "smollm"
    if kinds == [("ByteLevel", None, True)]:
        return "gpt2"
    raise StagelmError(f"the tokenizer's pre-tokenizer {kinds} has no llama.cpp name; GGUF export cannot say it")


def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write stagelm model `model_dir` as a llama GGUF at `out` (matrices in `dtype`, norms float32),
    with its tokenizer, special tokens and chat template, atomically."""
    import gguf

    if dtype not in DTYPES:
        raise StagelmError(f"--dtype: {dtype!r}; expected one of {', '.join(DTYPES)}")
    model_dir, out = Path(model_dir), Path(out)
    check_gguf_target(model_dir, out)
    model = load_model(model_dir)
    if model.cfg.lora_rank:
        raise StagelmError(f"{model_dir}: holds unmerged LoRA adapters; export the merged model (runs/sft/model)")
    tok = load_tokenizer(model_dir / "tokenizer.json")
    chat = load_chat_format(tok, model_dir)
    cfg, context = model.cfg, read_model_context(model_dir)
    try:
        tokens, types, merges = vocabulary(tok)
        pre = pre_tokenizer_name(tok)
    except StagelmError as err:  # a tokenizer GGUF cannot describe: name its file
        raise StagelmError(f"{model_dir / 'tokenizer.json'}: {err}") from None
    if len(tokens) < cfg.vocab_size:  # embedding rows beyond the tokenizer: llama.cpp wants a token for each
        tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
        types += [TOKEN_USER_DEFINED] * (cfg.vocab_size - len(types))

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name(model_dir.parent.name if model_dir.name == "model" else model_dir.name)
    writer.add_context_length(context)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(FILE_TYPES[dtype])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if chat.bos is not None:
        writer.add_bos_token_id(chat.bos)
    writer.add_eos_token_id(chat.eos)
    writer.add_pad_token_id(chat.pad)
    writer.add_add_bos_token(chat.add_bos)
    end_of_turn = [s for s in chat.stops if s != chat.eos]
    if end_of_turn:
        writer.add_eot_token_id(end_of_turn[0])
    writer.add_chat_template(chat.template or CHAT_TEMPLATE)
    kept = add_tensors(writer, gguf_names(llama_tensors(model), cfg), dtype)
    if kept:
        print(
            f"export-gguf: {dtype} for every matrix but {len(kept)} whose rows are not a multiple of 32, "
            f"kept float16: {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}; norms float32"
        )
    return write_atomically(writer, out)


def check_gguf_target(model_dir: Path, out: Path) -> None:
    """Refuse a GGUF path that is a folder, a device or a pipe (--force would put a file in its place), or
    lies inside the model being exported (over the model's own files, or beside them where its hashes do not
    cover), as export-hf refuses it."""
    if out.is_dir():
        raise StagelmError(f"{out}: a folder; give export-gguf the path of the .gguf file to write")
    if os.path.lexists(out) and not (out.is_symlink() or out.is_file()):  # a rename would replace the node itself
        raise StagelmError(
            f"{out}: a device, pipe or socket, not a file; give export-gguf the path of a .gguf to write"
        )
    if out.parent.resolve().is_relative_to(model_dir.resolve()):
        raise StagelmError(f"{out}: is inside the model being exported; give export-gguf a path outside {model_dir}")


# llama.cpp's file types (LLAMA_FTYPE_*): what model.gguf says its matrices mostly are.
FILE_TYPES = {"float32": 0, "float16": 1, "q4_0": 2, "q8_0": 7, "bfloat16": 32}
QUANTIZED = {"q8_0": "Q8_0", "q4_0": "Q4_0"}  # block quantization of 32 values a row at a time


def add_tensors(writer: Any, tensors: dict[str, np.ndarray], dtype: str) -> list[str]:
    """Add every tensor to `writer`: norms (1-D) in float32, matrices in `dtype`. A block-quantized
    dtype (q8_0, q4_0) takes rows of a multiple of 32 values; a matrix whose rows are not stays
    float16, as llama.cpp's own quantizer leaves it. Returns the names of the matrices kept so."""
    import gguf

    kept = []
    for name, values in tensors.items():
        values = np.ascontiguousarray(values, np.float32)
        target = dtype
        if dtype in QUANTIZED and values.ndim == 2 and values.shape[-1] % 32:
            target = "float16"
            kept.append(name)
        if values.ndim == 1 or target == "float32":
            writer.add_tensor(name, values)
        elif target == "float16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[QUANTIZED.get(target, "BF16")]
            packed = gguf.quants.quantize(values, kind)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=kind)
    return kept


def gguf_names(tensors: dict[str, np.ndarray], cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """transformers' Llama state dict under llama.cpp's names, q and k permuted for its RoPE."""
    whole = {v: k for k, v in WHOLE_NAMES.items()}
    layer = {v: k for k, v in LAYER_NAMES.items()}
    out = {}
    for name, values in tensors.items():
        stem, _, kind = name.rpartition(".")
        if stem.startswith("model.layers."):
            index, _, what = stem.removeprefix("model.layers.").partition(".")
            if what == "self_attn.q_proj":
                values = permute(values, cfg.n_heads)
            elif what == "self_attn.k_proj":
                values = permute(values, cfg.n_kv_heads)
            out[f"blk.{index}.{layer[what]}.{kind}"] = values
        else:
            out[f"{whole[stem]}.{kind}"] = values
    return out


def write_atomically(writer: Any, out: Path) -> Path:
    """The GGUF `writer` holds, written to a temporary file beside `out` and renamed over it, with
    the mode a new file gets: a failed write leaves `out` as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")  # no one else's name
    os.close(fd)
    part = Path(name)
    try:
        with naming(out):
            writer.write_header_to_file(path=part)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        os.chmod(part, file_mode())
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    return out
