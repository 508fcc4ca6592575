"""Byte-level BPE tokenizer (Hugging Face `tokenizers`) and the chat template.

Pre-tokenization splits digits into single-digit pieces before the byte-level step,
so numbers are spelled digit by digit (small models learn arithmetic far better
that way). Byte-level BPE means every unicode string round-trips exactly.

Special tokens take the first ids of a trained tokenizer, in this order: pad 0, bos 1,
eos 2, then the chat roles and the end-of-turn marker; code looks them up by name. A
checkpoint's own tokenizer (`model.init_from`) is written unchanged, its ids and specials its
own, with a chat.json beside it naming its chat template and end-of-turn tokens
(stagelm.data.chatformat). stagelm's own chat template is::

    <|user|>{user text}<|end|><|assistant|>{assistant text}<|end|>

and only the assistant text and its `<|end|>` are trained on in SFT. Only the template
inserts special tokens, by id: text from a user or a file is always text, so every
tokenizer stagelm loads encodes `<|end|>` typed in a message, or `<|eos|>` in a corpus
document, as the characters it is made of (`encode_special_tokens`, which tokenizer.json
does not store, so it is set at every load).

BPE trains on a bounded sample of the training split (`TrainingSample`,
`tokenizer.max_train_chars`), so its time and memory do not grow with the corpus.
A document longer than MAX_PIECE_CHARS reaches pack's encoder in pieces of that size,
and BPE's trainer in pieces of TRAIN_PIECE_CHARS (`pieces`), each cut before whitespace
where it has some: one encoding holds ~60 bytes a token, and BPE's training time grows
with a word's length times the merges (0.5 MB of text without a space: 83 s; the same
2 MB in 1,024-character pieces: 2 s). The pieces stay one document: pack joins their
ids and ends the whole with one `<|eos|>`.
"""

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import MIN_VOCAB  # 256 + len(SPECIAL_TOKENS): tokenizer.vocab_size's floor

PAD, BOS, EOS, USER, ASSISTANT, END = "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT, END]
MAX_PIECE_CHARS = 1 << 16  # characters of a document encoded at a time
TRAIN_PIECE_CHARS = 1 << 10  # characters of such a document BPE trains on at a time


def pieces(text: str, limit: int = MAX_PIECE_CHARS) -> list[str]:
    """`text` in consecutive pieces of at most `limit` characters. Each cut falls just before
    the last whitespace of the window's second half, where the pre-tokenizer cuts too (so
    the ids are those of the whole text), or at the limit when that half has none."""
    out, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        cut = max(text.rfind(" ", start + limit // 2, end), text.rfind("\n", start + limit // 2, end))
        cut = cut if cut > start else end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE with single-digit pre-tokenization on `texts`."""
    if vocab_size < MIN_VOCAB:
        raise StagelmError(
            f"tokenizer.vocab_size: {vocab_size} is below {MIN_VOCAB} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} specials); raise it"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class TrainingSample:
    """The documents BPE trains on, as batches: every document, in order, when they hold at
    most `max_chars` characters; otherwise each document is kept when a hash of `seed` and
    its index falls under max_chars / total (a uniform sample of the whole split, the same
    on every run), in order, up to `max_chars` characters in all.

    `read()` yields the split's documents in batches and is called twice (to count, then to
    draw), so memory is bounded by one batch plus what BPE keeps. After iterating,
    `documents` and `chars` say what was used and `total_documents`, `total_chars` what
    there was.
    """

    def __init__(self, read: Callable[[], Iterable[list[str]]], max_chars: int, seed: int):
        self.read, self.max_chars, self.seed = read, max_chars, seed
        self.documents = self.chars = self.total_documents = self.total_chars = 0

    def keeps(self, index: int, share: float) -> bool:
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < share * 2**64

    def __iter__(self) -> Iterator[list[str]]:
        self.total_documents = self.total_chars = 0
        for batch in self.read():
            self.total_documents += len(batch)
            self.total_chars += sum(len(t) for t in batch)
        share = min(1.0, self.max_chars / max(self.total_chars, 1))
        self.documents = self.chars = index = 0
        for batch in self.read():
            chosen = []
            for text in batch:
                if (share == 1.0 or self.keeps(index, share)) and self.chars + len(text) <= self.max_chars:
                    chosen.append(text)
                    self.chars += len(text)
                index += 1
            self.documents += len(chosen)
            if chosen:
                yield [p for t in chosen for p in (pieces(t, TRAIN_PIECE_CHARS) if len(t) > MAX_PIECE_CHARS else [t])]


def read_tokenizer_file(path: str | Path, fix: str) -> Tokenizer:
    """A tokenizer.json, or one line naming the file and `fix` (what to do) when it is missing or invalid."""
    path = Path(path)
    if not path.is_file():
        raise StagelmError(f"{path}: tokenizer not found; {fix}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception:
        raise StagelmError(f"{path}: not a valid tokenizer.json; {fix}") from None


CHAT_FILE = "chat.json"  # beside a checkpoint's tokenizer.json: its chat template (stagelm.data.chatformat)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A model's tokenizer, with text encoded as text (a special token's spelling in it is not the
    token). Without a chat.json beside it, it is stagelm's own and holds every stagelm special (at
    any id); with one, it is a checkpoint's own, whose specials chat.json names."""
    path = Path(path)
    tok = read_tokenizer_file(path, "run `dvc repro -f tokenizer`")
    if not (path.parent / CHAT_FILE).is_file():
        for special in SPECIAL_TOKENS:
            if tok.token_to_id(special) is None:
                raise StagelmError(
                    f"{path}: special token {special} is missing and no {CHAT_FILE} names its own; rebuild it with "
                    "`dvc repro -f tokenizer`, or import a checkpoint with `stagelm import-hf`"
                )
    tok.encode_special_tokens = True
    return tok


def special_id(tok: Tokenizer, token: str) -> int:
    return tok.token_to_id(token)


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text as int32 arrays (multi-threaded in the Rust core)."""
    return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]


def encode_joined(
    tok: Tokenizer, texts: Sequence[str], end: int, start: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(the texts' token ids each followed by `end` (and after `start` when given, a tokenizer whose
    text begins with bos), as one int32 array; each text's length with them).

    The cheapest way out of the Rust core for many documents: one list of ids and one
    array, no array per document (the Python side costs ~5% of the encoding itself)."""
    flat: list[int] = []
    lengths = np.empty(len(texts), np.int64)
    parts = [pieces(t) if len(t) > MAX_PIECE_CHARS else [t] for t in texts]  # a long document: its pieces, joined
    encodings = iter(tok.encode_batch_fast([p for ps in parts for p in ps], add_special_tokens=False))
    head = [] if start is None else [start]
    for i, ps in enumerate(parts):
        ids = next(encodings).ids if len(ps) == 1 else [t for _ in ps for t in next(encodings).ids]
        flat += head
        flat += ids
        flat.append(end)
        lengths[i] = len(head) + len(ids) + 1
    return np.array(flat, np.int32), lengths


def chat_segments(tok: Tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation; the mask is 1 on assistant text and its `<|end|>`."""
    ids: list[int] = []
    mask: list[int] = []
    role_ids = {"user": special_id(tok, USER), "assistant": special_id(tok, ASSISTANT)}
    end = special_id(tok, END)
    for message in messages:
        role = message["role"]
        if role not in role_ids:
            raise StagelmError(f"chat message role {role!r} is not 'user' or 'assistant'")
        body = tok.encode(message["content"], add_special_tokens=False).ids + [end]
        trained = int(role == "assistant")
        ids += [role_ids[role]] + body
        mask += [0] + [trained] * len(body)
    return ids, mask


def chat_prompt_ids(tok: Tokenizer, user_text: str) -> list[int]:
    """Ids of a one-turn chat prompt ready for the assistant's answer."""
    ids, _ = chat_segments(tok, [{"role": "user", "content": user_text}])
    return ids + [special_id(tok, ASSISTANT)]
