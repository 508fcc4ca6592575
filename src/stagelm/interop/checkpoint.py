"""A checkpoint no one here trained, as stagelm reads it: a transformers Llama folder or a llama GGUF file.

    stagelm import-hf <folder or GGUF file> <model dir>     # a model directory generate, serve and eval take
    model.init_from: hf:inputs/smollm2 | gguf:inputs/smollm2.gguf   # the pipeline's pretrain starts from it

Either way the checkpoint keeps its own tokenizer and chat format: the tokenizer.json is the
folder's (or rebuilt from the GGUF's metadata) unchanged, and chat.json records its chat
template and the tokens that end a turn (`stagelm.data.chatformat`), so every stage that renders
a chat, and the server, speak the checkpoint's format.
"""

import dataclasses
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from stagelm.data.tokenizer import read_tokenizer_file
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import regular_file_size
from stagelm.interop.gguf_import import gguf_chat_spec, gguf_config, gguf_tokenizer, import_gguf, open_gguf
from stagelm.interop.hf_import import hf_chat_spec, import_config, import_hf
from stagelm.model.decoder import Decoder, DecoderConfig

MAX_TOKENIZER_BYTES = 256 << 20  # a tokenizer.json past it is no tokenizer (the largest released are ~35 MB)


@dataclasses.dataclass
class Checkpoint:
    model: Decoder | None  # None when only the tokenizer was read
    context: int | None
    tokenizer: Tokenizer
    chat: dict[str, Any]  # chat.json's contents (its template None when the checkpoint has none)
    tokenizer_file: Path | None = None  # a folder's own tokenizer.json, copied byte for byte

    def tokenizer_json(self) -> bytes:
        """The checkpoint's tokenizer.json: the folder's own file, or the one rebuilt from a GGUF."""
        if self.tokenizer_file is not None:
            return self.tokenizer_file.read_bytes()
        return self.tokenizer.to_str(pretty=True).encode()


def checkpoint_source(init_from: str | None) -> Path | None:
    """The checkpoint `model.init_from` names (`hf:<folder>` or `gguf:<file>`), or None (from scratch)."""
    if init_from is None:
        return None
    scheme, _, rest = init_from.partition(":")
    path = Path(rest).expanduser()
    if scheme == "gguf" and not path.is_file():
        raise StagelmError(f"model.init_from: {path} is not a file; give a llama GGUF file under data.inputs")
    if scheme == "gguf" and not is_gguf(path):
        raise StagelmError(
            f"model.init_from: {path} is not a GGUF file (it does not start with the bytes GGUF); give a llama "
            "GGUF file, or hf:<folder> for a transformers checkpoint"
        )
    if scheme == "hf" and not (path / "config.json").is_file():
        raise StagelmError(f"model.init_from: {path} has no config.json; give a transformers checkpoint folder")
    return path


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file, whatever its name


def is_gguf(source: Path) -> bool:
    """Whether `source` is a regular file whose content is GGUF (by its magic bytes, not its name)."""
    if not source.is_file():  # a folder, or no regular file (a device or a pipe is never opened)
        return False
    with open(source, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def checkpoint_config(source: Path) -> tuple[DecoderConfig, int]:
    """(DecoderConfig, context length) of the checkpoint at `source`, from its config.json or GGUF
    metadata alone, checked as an import checks them: what sizes it before any weight is read."""
    if is_gguf(source):
        return gguf_config(open_gguf(source), source)
    return import_config(source)


def read_checkpoint(source: str | Path, weights: bool = True, vocab_size: int | None = None, **settings: Any):
    """The checkpoint at `source` (a transformers folder or a GGUF file, by its content): its model (unless
    `weights` is False), context length, own tokenizer and chat spec. `vocab_size` and `settings`
    as `llama_state.decoder_from_llama_tensors` takes them."""
    source = Path(source)
    if is_gguf(source):
        return read_gguf(source, weights, vocab_size, **settings)
    if source.is_file():
        raise StagelmError(
            f"{source}: not a GGUF file (it does not start with the bytes GGUF) nor a transformers checkpoint "
            "folder; give a llama GGUF file or the folder holding config.json"
        )
    if not source.is_dir():
        raise StagelmError(f"{source}: neither a transformers checkpoint folder nor a GGUF file; check the path")
    return read_hf_folder(source, weights, vocab_size, **settings)


def read_gguf(source: Path, weights: bool, vocab_size: int | None, **settings: Any) -> Checkpoint:
    if not weights:
        reader = open_gguf(source)
        tok = gguf_tokenizer(reader, source)
        return Checkpoint(None, None, tok, gguf_chat_spec(reader, tok, source))
    model, context, tok, spec = import_gguf(source, vocab_size, **settings)
    return Checkpoint(model, context, tok, spec)


def read_hf_folder(source: Path, weights: bool, vocab_size: int | None, **settings: Any) -> Checkpoint:
    import_config(source)  # the config, then the tokenizer, the weights and the chat spec: each checked before use
    tokenizer = source / "tokenizer.json"
    regular_file_size(tokenizer, MAX_TOKENIZER_BYTES, "the checkpoint needs a fast tokenizer's tokenizer.json")
    tok = read_tokenizer_file(tokenizer, "the checkpoint needs a fast tokenizer's tokenizer.json")
    model, context = import_hf(source, vocab_size, **settings) if weights else (None, None)
    spec = hf_chat_spec(source, tok)
    if not weights:
        return Checkpoint(None, None, tok, spec, tokenizer)
    if tok.get_vocab_size() > model.cfg.vocab_size:
        raise StagelmError(
            f"{tokenizer}: {tok.get_vocab_size():,} tokens, more than the model's vocab_size "
            f"{model.cfg.vocab_size:,}; give the checkpoint's own tokenizer"
        )
    return Checkpoint(model, context, tok, spec, tokenizer)
