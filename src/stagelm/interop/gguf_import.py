"""A llama GGUF file read into stagelm, through the `gguf` package: weights, tokenizer, chat spec.

    stagelm import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2     # or model.init_from: gguf:<file>

Import dequantizes every tensor to float32 (`gguf.quants.dequantize`), maps llama.cpp's
names to transformers' Llama state dict (`gguf_layout`) and builds the model with
`llama_state.decoder_from_llama_tensors`; it rebuilds tokenizer.json with `tokenizers` and
the chat spec from the template and the special token ids. Other pre-tokenizers, and
sentencepiece vocabularies, are refused in one line.
"""

import collections
import math
import mmap
import numbers
import struct
from pathlib import Path
from typing import Any

import numpy as np

from stagelm.infra.errors import StagelmError
from stagelm.interop.chat_spec import chat_spec
from stagelm.interop.gguf_layout import (
    LAYER_NAMES,
    PRE_TOKENIZERS,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_TYPES,
    TOKEN_USER_DEFINED,
    WHOLE_NAMES,
    unpermute,
)
from stagelm.interop.llama_state import (
    FLOAT_LIMITS,
    LIMITS,
    check_llama_tensors,
    config_float,
    config_int,
    decoder_from_llama_tensors,
)
from stagelm.model.decoder import Decoder, DecoderConfig


def open_gguf(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise StagelmError(f"{path}: no such GGUF file; give the path of a GGUF model")
    check_declared_sizes(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # its parser raises ValueError, struct errors and more on a damaged file
        raise StagelmError(f"{path}: not a readable GGUF file ({str(err)[:100]})") from None
    check_tensor_layout(reader, path)
    return reader


# GGUF's value types by their number: the fixed size of each scalar; 8 is a string, 9 an array.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9


def check_declared_sizes(path: Path) -> None:
    """Refuse a GGUF whose header declares more than the file holds, before the gguf package reads
    it: its reader walks a declared array item by item (a length of 2**50 in a 3 MB file would run
    for days) and answers a truncated file with numpy's words. Walks the counts, strings, arrays and
    tensor infos, and checks every tensor's data lies inside the file; anything else it leaves to
    the reader, which refuses it in its own words."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return
        if path.stat().st_size < 8:
            raise StagelmError(f"{path}: {path.stat().st_size} bytes, its GGUF header cut short; it is truncated")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            HeaderWalk(data, path).walk()


class HeaderWalk:
    """`check_declared_sizes` over the file's bytes `data` (a buffer struct can read)."""

    def __init__(self, data: Any, path: Path):
        self.data, self.path, self.at = data, path, 8  # after the magic and the version
        self.order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"  # as the reader tells it

    def take(self, n: int, what: str) -> int:
        """Step over `n` bytes of `what`; where they start."""
        left = len(self.data) - self.at
        if n > left:
            end = "it is truncated" if n < 2**40 else "the file is damaged"
            raise StagelmError(f"{self.path}: {what} declares {n:,} bytes where {left:,} are left; {end}")
        self.at += n
        return self.at - n

    def text(self, start: int, what: str) -> str:
        """The string from `start` to where the walk stands (its first 200 characters), as UTF-8."""
        try:
            return bytes(self.data[start : self.at]).decode()[:200]
        except UnicodeDecodeError:
            raise StagelmError(f"{self.path}: {what} is not UTF-8 text; the file is damaged") from None

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack_from(self.order + fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def value(self, kind: int, what: str) -> None:
        if kind in SCALAR_BYTES:
            self.take(SCALAR_BYTES[kind], what)
        elif kind == GGUF_STRING:
            self.take(self.number("Q", what), what)
        elif kind == GGUF_ARRAY:
            item, count = self.number("I", what), self.number("Q", what)
            first = self.take(count * SCALAR_BYTES.get(item, 8), what)  # a string or array item: 8 bytes or more
            if item not in SCALAR_BYTES:
                self.at = first  # they fit: walk them
                for _ in range(count):
                    self.value(item, what)
        else:  # past it the walk would read out of step: every later length a wrong number
            raise StagelmError(f"{self.path}: {what} has value type {kind}, none of GGUF's; the file is damaged")

    def walk(self) -> None:
        tensors, keys = self.number("Q", "the tensor count"), self.number("Q", "the metadata count")
        self.at = self.take(keys * 12, f"a metadata count of {keys:,}")  # a key's length and type at least
        alignment = 32
        for i in range(keys):
            start = self.take(self.number("Q", f"metadata key {i}"), f"metadata key {i}")
            key = self.text(start, f"metadata key {i}")
            kind = self.number("I", key)
            if key == "general.alignment" and kind == 4:  # a UINT32, as the reader requires
                alignment = self.number("I", key) or 32
            else:
                self.value(kind, f"metadata {key}")
        self.at = self.take(tensors * 24, f"a tensor count of {tensors:,}")  # name, dims, type, offset at least
        infos = [self.tensor_info(i) for i in range(tensors)]
        data_start = -(-self.at // alignment) * alignment
        for name, offset, size in infos:
            if data_start + offset + size > len(self.data):
                raise StagelmError(
                    f"{self.path}: tensor {name}'s {size:,} bytes of data from byte {data_start + offset:,} run past "
                    f"the end of the file at {len(self.data):,}; it is truncated"
                )

    def tensor_info(self, i: int) -> tuple[str, int, int]:
        """(name, data offset, bytes) of the next tensor info; 0 bytes for a type it does not know."""
        from gguf import GGML_QUANT_SIZES

        start = self.take(self.number("Q", f"tensor {i}'s name"), f"tensor {i}'s name")
        name = self.text(start, f"tensor {i}'s name")
        dims = self.number("I", f"tensor {name}")
        self.take(min(dims, 2**32) * 8, f"tensor {name}'s {dims:,} dimensions")
        count = math.prod(struct.unpack_from(f"{self.order}{dims}Q", self.data, self.at - dims * 8))
        kind, offset = self.number("I", f"tensor {name}"), self.number("Q", f"tensor {name}")
        block, size = GGML_QUANT_SIZES.get(kind, (1, 0)) if kind < 2**16 else (1, 0)
        return name, offset, count // block * size


def check_tensor_layout(reader: Any, path: Path) -> None:
    """Refuse tensor data that does not lie where llama.cpp's loader expects it: each tensor at the
    offset where the one before it ends, padded to general.alignment (a moved offset would read every
    weight shifted), all of it inside the file, and nothing after it."""
    expected = end = 0
    for t in reader.tensors:
        offset = int(t.data_offset) - int(reader.data_offset)
        if offset != expected:
            raise StagelmError(
                f"{path}: tensor {t.name} starts at data offset {offset:,}, but the tensors before it end at "
                f"{expected:,}; the file is damaged"
            )
        end = offset + int(t.n_bytes)
        expected = -(-end // int(reader.alignment)) * int(reader.alignment)  # numpy's uint32 would overflow
    if int(reader.data_offset) + end > len(reader.data):
        raise StagelmError(f"{path}: the tensors run past the end of the file; it is truncated")
    extra = len(reader.data) - int(reader.data_offset) - expected
    if extra > int(reader.alignment):  # writers pad the last tensor to the alignment, and stop there
        raise StagelmError(f"{path}: {extra:,} bytes follow the last tensor's data; the file is damaged")


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata `key` of a GGUF (a string, a number or a list), or `default` when absent."""
    found = reader.fields.get(key)
    try:
        return default if found is None else found.contents()
    except UnicodeDecodeError:  # a string (or a list's item) that is not UTF-8: llama.cpp refuses it too
        where = getattr(reader.data, "filename", None) or "the GGUF file"
        raise StagelmError(f"{where}: {key} holds bytes that are not UTF-8 text; the file is damaged") from None


def gguf_config(reader: Any, path: Path) -> tuple[DecoderConfig, int]:
    """(DecoderConfig, context length) of a `llama` GGUF's metadata, refusing what stagelm cannot run."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise StagelmError(f"{path}: general.architecture is {arch!r}; stagelm imports 'llama' GGUF models only")

    def size(key: str, limit: str, default: Any = None) -> int:  # the HF field whose limit applies
        return config_int(field(reader, f"llama.{key}", default), f"llama.{key}", path, LIMITS[limit])

    def number(key: str, limit: str, default: Any = None) -> float:  # the HF field whose limit applies
        return config_float(field(reader, f"llama.{key}", default), f"llama.{key}", path, FLOAT_LIMITS[limit])

    d, heads = size("embedding_length", "hidden_size"), size("attention.head_count", "num_attention_heads")
    kv = size("attention.head_count_kv", "num_key_value_heads", heads)
    if d % heads or heads % kv or (d // heads) % 2:
        raise StagelmError(
            f"{path}: llama.attention.head_count {heads} and head_count_kv {kv} do not fit llama.embedding_length "
            f"{d} (the heads must divide it into even head sizes, the kv heads the heads); the file is damaged"
        )
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if field(reader, f"llama.{key}") not in (None, d // heads):
            raise StagelmError(f"{path}: llama.{key} {field(reader, f'llama.{key}')} is not the head size {d // heads}")
    experts = field(reader, "llama.expert_count")
    if experts not in (None, 0):  # a mixture of experts: its tensors are not a dense Llama's
        raise StagelmError(f"{path}: llama.expert_count is {experts!r}; stagelm imports dense Llama models only")
    scaling = field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise StagelmError(f"{path}: llama.rope.scaling.type {scaling!r}; stagelm's RoPE has no scaling")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    cfg = DecoderConfig(
        vocab_size=size("vocab_size", "vocab_size", len(tokens) or None),
        d_model=d,
        n_layers=size("block_count", "num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=size("feed_forward_length", "intermediate_size"),
        rope_theta=number("rope.freq_base", "rope_theta", 10000.0),  # llama.cpp's own default when absent
        norm_eps=number("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )
    return cfg, size("context_length", "max_position_embeddings")


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
        if name in out:
            raise StagelmError(f"{path}: tensor {t.name} appears twice; the file is damaged")
        out[name] = values
    check_llama_tensors(cfg, out, path, GGUF_KEYS, gguf_name)  # before unpermuting, which reshapes by the head counts
    for name, values in out.items():
        if name.endswith("q_proj.weight"):
            out[name] = unpermute(values, cfg.n_heads)
        elif name.endswith("k_proj.weight"):
            out[name] = unpermute(values, cfg.n_kv_heads)
    return out


def gguf_name(name: str) -> str:
    """A transformers Llama tensor name as llama.cpp spells it (`model.layers.0.self_attn.q_proj.bias` →
    `blk.0.attn_q.bias`), for errors in the file's own words."""
    layer = {v: k for k, v in LAYER_NAMES.items()}
    whole = {v: k for k, v in WHOLE_NAMES.items()}
    stem, _, kind = name.rpartition(".")
    if stem.startswith("model.layers."):
        index, _, what = stem.removeprefix("model.layers.").partition(".")
        return f"blk.{index}.{layer.get(what, what)}.{kind}"
    return f"{whole.get(stem, stem)}.{kind}"


GGUF_KEYS = {  # the GGUF keys that set each dimension (llama_state.check_llama_tensors)
    "d": "llama.embedding_length",
    "heads": "llama.attention.head_count",
    "kv": "llama.attention.head_count_kv",
    "ff": "llama.feed_forward_length",
    "vocab": "llama.vocab_size (or the token list)",
    "layers": "llama.block_count",
    "tie": "no output.weight",
}


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
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise StagelmError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer stagelm rebuilds ({sorted(PRE_TOKENIZERS)}); "
            "import the model's transformers folder instead"
        )
    tokens, types, merges = gguf_vocabulary(reader, path)
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


def gguf_vocabulary(reader: Any, path: Path) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """(tokens, their types, merges) of a GGUF's byte-level BPE, each checked: a list of distinct
    strings, one type per token, merges of two tokens the vocabulary holds."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise StagelmError(f"{path}: tokenizer.ggml.tokens is missing or not a list of strings; the file is damaged")
    repeated = next((t for t, n in collections.Counter(tokens).items() if n > 1), None)
    if repeated is not None:
        raise StagelmError(f"{path}: tokenizer.ggml.tokens holds {repeated!r} twice; the file is damaged")
    types = field(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise StagelmError(
            f"{path}: tokenizer.ggml.token_type has {len(types) if isinstance(types, list) else 'no list of'} "
            f"entries for {len(tokens)} tokens; the file is damaged"
        )
    valid = (isinstance(t, numbers.Integral) and not isinstance(t, bool) and t in TOKEN_TYPES for t in types)
    wrong = next((t for t, ok in zip(types, valid, strict=True) if not ok), None)
    if wrong is not None:
        raise StagelmError(
            f"{path}: tokenizer.ggml.token_type holds {str(wrong)[:40]!r}, not one of llama.cpp's token types "
            f"{TOKEN_TYPES.start} to {TOKEN_TYPES.stop - 1}; the file is damaged"
        )
    found = field(reader, "tokenizer.ggml.merges", None)
    if found is None:  # llama.cpp refuses a BPE vocabulary without its merges: every word would split to characters
        raise StagelmError(f"{path}: tokenizer.ggml.merges missing; a byte-level BPE needs them, the file is damaged")
    if not isinstance(found, list):
        raise StagelmError(f"{path}: tokenizer.ggml.merges is {str(found)[:40]!r}, not a list; the file is damaged")
    vocab, merges = set(tokens), []
    for m in found:
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else ()
        if len(pair) != 2 or not set(pair) <= vocab:
            raise StagelmError(
                f"{path}: tokenizer.ggml.merges holds {str(m)[:40]!r}, not two tokens of the vocabulary; "
                "the file is damaged"
            )
        merges.append(pair)
    return tokens, types, merges


def gguf_chat_spec(reader: Any, tok: Any, path: Path) -> dict[str, Any]:
    """chat.json (stagelm.data.chatformat) of a GGUF's template (None without one) and special token ids."""

    def spelled(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not isinstance(index, numbers.Integral) or isinstance(index, bool) or not 0 <= index < tok.get_vocab_size():
            raise StagelmError(
                f"{path}: tokenizer.ggml.{key} {repr(index)[:40]} is not a token id (0 to {tok.get_vocab_size() - 1})"
            )
        return tok.id_to_token(int(index))

    eos = spelled("eos_token_id")
    if eos is None:
        raise StagelmError(f"{path}: tokenizer.ggml.eos_token_id missing; stagelm needs the token that ends a text")
    template = field(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise StagelmError(f"{path}: tokenizer.chat_template is {str(template)[:40]!r}; expected a Jinja string")
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise StagelmError(f"{path}: tokenizer.ggml.add_bos_token = {str(add_bos)[:40]!r}; expected true or false")
    return chat_spec(
        tok,
        path,
        template=template,
        eos=eos,
        bos=spelled("bos_token_id"),
        pad=spelled("padding_token_id"),
        unk=spelled("unknown_token_id"),
        stops=[eos, spelled("eot_token_id"), spelled("eom_token_id")],
        add_bos=add_bos,
    )


def import_gguf(path: str | Path, vocab_size: int | None = None, **settings: Any) -> tuple[Decoder, int, Any, Any]:
    """(Decoder, context length, tokenizer, chat spec or None) of a llama GGUF file; `vocab_size` and
    `settings` as `llama_state.decoder_from_llama_tensors` takes them."""
    path = Path(path)
    reader = open_gguf(path)
    cfg, context = gguf_config(reader, path)
    tok = gguf_tokenizer(reader, path)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise StagelmError(
            f"{path}: tokenizer.ggml.tokens holds {tok.get_vocab_size()} tokens but llama.vocab_size is "
            f"{cfg.vocab_size}; tokens beyond the embedding could never be read"
        )
    spec = gguf_chat_spec(reader, tok, path)
    tensors = gguf_tensors(reader, cfg, path)
    model = decoder_from_llama_tensors(cfg, tensors, path, vocab_size, GGUF_KEYS, gguf_name, **settings)
    return model, context, tok, spec
