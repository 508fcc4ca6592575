"""GGUF, llama.cpp's model file: a checkpoint in, and a stagelm model out, through the `gguf` package.

    stagelm import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2     # or model.init_from: gguf:<file>
    stagelm export-gguf runs/sft/model runs/sft.gguf [--dtype float16]     # the export@ stages write one too

A GGUF of the `llama` architecture holds the weights (quantized or not) under llama.cpp's
names, the hyperparameters as `llama.*` metadata, and the tokenizer as lists (tokens, their
types, BPE merges) beside its pre-tokenizer's name and the chat template. Import dequantizes
every tensor to float32 (`gguf.quants.dequantize`), maps the names to transformers' Llama
state dict and builds the model with `hf.decoder_from_hf`; it rebuilds tokenizer.json with
`tokenizers` and writes chat.json from the template and the special token ids.

llama.cpp's converter stores each q and k projection with its rows permuted for llama.cpp's
RoPE, which rotates adjacent pairs where transformers (and stagelm) rotate halves: within
each head the rows are cut in two halves and interleaved. Import undoes it (`unpermute`) and
export does it (`permute`), k with its own (kv) head count.

The byte-level BPE pre-tokenizers stagelm rebuilds are named as llama.cpp names them
(`PRE_TOKENIZERS`): stagelm's own (single digits, then GPT-2's split) is llama.cpp's
`smollm`, so a stagelm model's GGUF tokenizes in llama.cpp as it does here. Other
pre-tokenizers, and sentencepiece vocabularies, are refused in one line.
"""

import os
from pathlib import Path
from typing import Any

import numpy as np

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import file_mode, naming
from stagelm.model.decoder import Decoder, DecoderConfig

# llama.cpp's GGUF names for transformers' Llama weights, per layer and whole.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
WHOLE_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# tokenizer.ggml.pre → the regexes llama.cpp splits text with, as a `tokenizers` pre-tokenizer spec:
# "digits" splits every digit off first (\p{N}), then GPT-2's byte-level split, as stagelm's own does.
PRE_TOKENIZERS = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), "digits"),
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo", "jais"), "gpt2"),
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' (out, in) q or k rows → llama.cpp's: each head's two halves interleaved."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's (out, in) q or k rows → transformers': the inverse of `permute`."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# --- reading ------------------------------------------------------------------------------


def open_gguf(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise StagelmError(f"{path}: no such GGUF file; give the path of a .gguf model")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:  # its parser raises ValueError, struct errors and more on a damaged file
        raise StagelmError(f"{path}: not a readable GGUF file ({str(err)[:100]})") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata `key` of a GGUF (a string, a number or a list), or `default` when absent."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def gguf_config(reader: Any, path: Path) -> tuple[DecoderConfig, int]:
    """(DecoderConfig, context length) of a `llama` GGUF's metadata, refusing what stagelm cannot run."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise StagelmError(f"{path}: general.architecture is {arch!r}; stagelm imports 'llama' GGUF models only")

    def number(key: str, default: Any = None) -> Any:
        value = field(reader, f"llama.{key}", default)
        if value is None:
            raise StagelmError(f"{path}: llama.{key} missing; a llama GGUF needs it")
        return value

    d, heads = int(number("embedding_length")), int(number("attention.head_count"))
    kv = int(number("attention.head_count_kv", heads))
    if d % heads or heads % kv or (d // heads) % 2:
        raise StagelmError(f"{path}: {heads} heads and {kv} kv heads do not fit an embedding of {d}")
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if field(reader, f"llama.{key}") not in (None, d // heads):
            raise StagelmError(f"{path}: llama.{key} {field(reader, f'llama.{key}')} is not the head size {d // heads}")
    scaling = field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise StagelmError(f"{path}: llama.rope.scaling.type {scaling!r}; stagelm's RoPE has no scaling")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    cfg = DecoderConfig(
        vocab_size=int(number("vocab_size", len(tokens) or None)),
        d_model=d,
        n_layers=int(number("block_count")),
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=int(number("feed_forward_length")),
        rope_theta=float(number("rope.freq_base", 10000.0)),  # llama.cpp's own default when absent
        norm_eps=float(number("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )
    return cfg, int(number("context_length"))


def gguf_tensors(reader: Any, cfg: DecoderConfig, path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under transformers' Llama names, q and k unpermuted."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        stem, _, kind = t.name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
        elif stem in WHOLE_NAMES:
            name = f"{WHOLE_NAMES[stem]}.{kind}"
        else:
            raise StagelmError(f"{path}: tensor {t.name} has no place in a Llama decoder; not a plain llama GGUF")
        try:
            values = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape)))
        except NotImplementedError:
            raise StagelmError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        if name.endswith("q_proj.weight"):
            values = unpermute(values, cfg.n_heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute(values, cfg.n_kv_heads)
        out[name] = values
    return out


def gguf_tokenizer(reader: Any, path: Path) -> Any:
    """The tokenizer a GGUF describes, as a `tokenizers` Tokenizer: byte-level BPE over its tokens
    and merges, split as llama.cpp splits for its `tokenizer.ggml.pre`, its control tokens special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise StagelmError(
            f"{path}: tokenizer.ggml.model {model!r}; stagelm rebuilds byte-level BPE ('gpt2') tokenizers only "
            "(import the model's transformers folder, with its tokenizer.json, instead)"
        )
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise StagelmError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer stagelm rebuilds ({sorted(PRE_TOKENIZERS)}); "
            "import the model's transformers folder instead"
        )
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if PRE_TOKENIZERS[pre] == "digits":
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED]
    )
    return tok


def gguf_chat_spec(reader: Any, tok: Any, path: Path) -> dict[str, Any]:
    """chat.json (stagelm.data.chatformat) of a GGUF's template (None without one) and special token ids."""
    from stagelm.interop.hf import with_end_of_turn

    template = field(reader, "tokenizer.chat_template")
    if not isinstance(template, str) or not template.strip():
        template = None

    def spelled(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}")
        return tok.id_to_token(int(index)) if index is not None else None

    eos = spelled("eos_token_id")
    if eos is None:
        raise StagelmError(f"{path}: tokenizer.ggml.eos_token_id missing; stagelm needs the token that ends a text")
    stops = [eos] + [t for t in (spelled("eot_token_id"), spelled("eom_token_id")) if t]
    spec = {
        "template": template,
        "bos_token": spelled("bos_token_id"),
        "eos_token": eos,
        "pad_token": spelled("padding_token_id") or eos,
        "unk_token": spelled("unknown_token_id"),
        "stop_tokens": list(dict.fromkeys(stops)),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    return with_end_of_turn(spec, tok, path)


def import_gguf(path: str | Path, vocab_size: int | None = None, **settings: Any) -> tuple[Decoder, int, Any, Any]:
    """(Decoder, context length, tokenizer, chat spec or None) of a llama GGUF file; `vocab_size` and
    `settings` as `hf.decoder_from_hf` takes them."""
    from stagelm.interop.hf import decoder_from_hf

    path = Path(path)
    reader = open_gguf(path)
    cfg, context = gguf_config(reader, path)
    tok = gguf_tokenizer(reader, path)
    spec = gguf_chat_spec(reader, tok, path)
    model = decoder_from_hf(cfg, gguf_tensors(reader, cfg, path), path, vocab_size, **settings)
    return model, context, tok, spec


# --- writing ------------------------------------------------------------------------------

DTYPES = ("float32", "float16", "bfloat16")


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

    from stagelm.data.chatformat import load_chat_format
    from stagelm.data.tokenizer import load_tokenizer
    from stagelm.interop.hf import CHAT_TEMPLATE, hf_tensors
    from stagelm.model.modeldir import load_model, read_model_context

    if dtype not in DTYPES:
        raise StagelmError(f"--dtype: {dtype!r}; expected one of {', '.join(DTYPES)}")
    model_dir, out = Path(model_dir), Path(out)
    model = load_model(model_dir)
    if model.cfg.lora_rank:
        raise StagelmError(f"{model_dir}: holds unmerged LoRA adapters; export the merged model (runs/sft/model)")
    tok = load_tokenizer(model_dir / "tokenizer.json")
    chat = load_chat_format(tok, model_dir)
    cfg, context = model.cfg, read_model_context(model_dir)
    tokens, types, merges = vocabulary(tok)
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
    kind = {"float32": gguf.GGMLQuantizationType.F32, "float16": gguf.GGMLQuantizationType.F16}
    kind["bfloat16"] = gguf.GGMLQuantizationType.BF16
    writer.add_file_type({"float32": 0, "float16": 1, "bfloat16": 32}[dtype])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tok))
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
    for name, values in gguf_names(hf_tensors(model), cfg).items():
        values = np.ascontiguousarray(values, np.float32)
        if values.ndim == 1 or dtype == "float32":
            writer.add_tensor(name, values)
        elif dtype == "float16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            packed = gguf.quants.quantize(values, kind["bfloat16"])
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=kind["bfloat16"])
    return write_atomically(writer, out)


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
    part = out.with_name(f".{out.name}.tmp")
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
