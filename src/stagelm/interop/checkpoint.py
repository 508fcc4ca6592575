"""A checkpoint no one here trained, as stagelm reads it: a transformers Llama folder or a llama GGUF file.

    stagelm import-hf <folder or .gguf> <model dir>     # a model directory generate, serve and eval take
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
from stagelm.model.decoder import Decoder

SCHEMES = ("hf", "gguf")


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


def source_path(init_from: str) -> Path:
    """The file or folder of `model.init_from` (`hf:<folder>` or `gguf:<file>`)."""
    scheme, _, rest = init_from.partition(":")
    return Path(rest).expanduser() if scheme in SCHEMES else Path(init_from)


def is_gguf(source: Path) -> bool:
    return source.is_file() and source.suffix.lower() == ".gguf"


def read_checkpoint(source: str | Path, weights: bool = True, vocab_size: int | None = None, **settings: Any):
    """The checkpoint at `source` (a transformers folder or a .gguf file): its model (unless
    `weights` is False), context length, own tokenizer and chat spec. `vocab_size` and `settings`
    as `hf.decoder_from_hf` takes them."""
    from stagelm.interop.gguf_file import import_gguf, open_gguf
    from stagelm.interop.hf import hf_chat_spec, import_config, import_hf

    source = Path(source)
    if is_gguf(source):
        if not weights:
            from stagelm.interop.gguf_file import gguf_chat_spec, gguf_tokenizer

            reader = open_gguf(source)
            tok = gguf_tokenizer(reader, source)
            return Checkpoint(None, None, tok, gguf_chat_spec(reader, tok, source))
        model, context, tok, spec = import_gguf(source, vocab_size, **settings)
        return Checkpoint(model, context, tok, spec)
    if not source.is_dir():
        raise StagelmError(f"{source}: neither a transformers checkpoint folder nor a .gguf file; check the path")
    import_config(source)  # the config, then the tokenizer, the weights and the chat spec: each checked before use
    tokenizer = source / "tokenizer.json"
    if not tokenizer.is_file():
        raise StagelmError(f"{tokenizer}: missing; the checkpoint needs a fast tokenizer's tokenizer.json")
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
