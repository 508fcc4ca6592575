"""The pack stage's library: tokenize documents and pack them into fixed-length rows.

A row holds `seq_len + 1` tokens so that a training step sees `seq_len` inputs and
their `seq_len` shifted targets. The packers build each row's columns as `(rows,
row_len)` int32 arrays:

- `tokens`: token ids, `<|pad|>` (0) after the last document;
- `segment_ids`: 1, 2, ... for the documents (or pieces of one) inside the row, 0 for padding;
- `positions`: the position within the segment, restarting at 0 for each segment;
- `loss_mask` (SFT only): 1 on the tokens to train on (assistant text and its end token).

`ShardWriter` stores them compactly (`stagelm.data.shard_format`: about 2 bytes a token) in Arrow
IPC shards, written as they fill, with manifest.json last.

Every document is followed by `<|eos|>`. The corpus splits are packed by
concatenate-and-chunk (a document may straddle rows, nearly no padding); SFT
conversations are packed next-fit so that a conversation stays whole within a row
unless it is longer than a row. Either way the non-pad tokens, read row by row, are
exactly the documents' tokens plus their EOSes, in order.
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from stagelm.data.chatformat import ChatFormat
from stagelm.data.shard_format import SCHEMA_VERSION, encode_rows, token_type
from stagelm.data.tokenizer import encode_joined
from stagelm.infra.files import naming, sha256_file, write_json


def segment_layout(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) of rows whose tokens belong to documents `doc_ids` (-1 = padding)."""
    rows, width = doc_ids.shape
    cols = np.broadcast_to(np.arange(width), (rows, width))
    starts = np.ones_like(doc_ids, dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    positions = (cols - np.maximum.accumulate(np.where(starts, cols, 0), axis=1)).astype(np.int32)
    pad = doc_ids < 0
    segment_ids[pad] = 0
    positions[pad] = 0
    return segment_ids, positions


def pack_stream(docs: list[np.ndarray], row_len: int, eos: int) -> dict[str, np.ndarray]:
    """Concatenate documents (each + the `eos` id) and cut into rows of `row_len`; pad the last row."""
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    flat = np.concatenate([np.append(d, eos).astype(np.int32) for d in docs])
    doc_of = np.repeat(np.arange(len(docs)), lengths)
    n_rows = -(-len(flat) // row_len)
    padded = n_rows * row_len - len(flat)
    tokens = np.concatenate([flat, np.zeros(padded, np.int32)]).reshape(n_rows, row_len)
    doc_ids = np.concatenate([doc_of, np.full(padded, -1)]).reshape(n_rows, row_len)
    segment_ids, positions = segment_layout(doc_ids)
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}


def pack_next_fit(docs: list[np.ndarray], masks: list[np.ndarray], row_len: int, eos: int) -> dict[str, np.ndarray]:
    """Pack documents (each + the `eos` id) whole into rows, opening a new row when one does not fit."""
    pieces: list[tuple[int, np.ndarray, np.ndarray]] = []  # (doc index, tokens, mask)
    for i, (doc, mask) in enumerate(zip(docs, masks, strict=True)):
        doc, mask = np.append(doc, eos), np.append(mask, 0)
        for start in range(0, len(doc), row_len):  # only a doc longer than a row is cut
            pieces.append((i, doc[start : start + row_len], mask[start : start + row_len]))
    rows: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for piece in pieces:
        if used + len(piece[1]) > row_len:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += len(piece[1])
    tokens = np.zeros((len(rows), row_len), np.int32)
    loss_mask = np.zeros((len(rows), row_len), np.int32)
    doc_ids = np.full((len(rows), row_len), -1)
    for r, row in enumerate(rows):
        col = 0
        for doc, toks, mask in row:
            end = col + len(toks)
            tokens[r, col:end], loss_mask[r, col:end], doc_ids[r, col:end] = toks, mask, doc
            col = end
    segment_ids, positions = segment_layout(doc_ids)
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "loss_mask": loss_mask}


class ShardWriter:
    """Arrow IPC shards of `rows_per_shard` rows in `out_dir`, each written (and renamed into
    place) as soon as it fills; `finish` writes the last one and then manifest.json, so a
    killed run never leaves a manifest over partial shards. Memory: one shard of rows.
    Shards are named `shard-NNNNN.arrow`; an old manifest is removed first."""

    def __init__(self, out_dir: Path, row_len: int, rows_per_shard: int, vocab_size: int):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "manifest.json").unlink(missing_ok=True)
        for old in out_dir.glob("shard-*.arrow"):
            old.unlink()
        self.out_dir, self.row_len, self.rows_per_shard = out_dir, row_len, rows_per_shard
        self.vocab_size = vocab_size
        self.pending: list[dict[str, np.ndarray]] = []
        self.pending_rows = self.rows = self.real = 0
        self.counts = np.zeros(0, np.int64)  # token frequencies of the non-pad tokens
        self.shards: list[dict] = []
        self.columns: list[str] = []

    def add(self, columns: dict[str, np.ndarray]) -> None:
        """Append rows (each column (rows, row_len)); full shards are written at once."""
        self.pending.append(columns)
        self.pending_rows += len(columns["tokens"])
        while self.pending_rows >= self.rows_per_shard:
            self.write(self.rows_per_shard)

    def put(self, columns: dict[str, np.ndarray], number: int) -> None:
        """Write `columns` at once as shard `number` (when processes share a split's shards)."""
        assert not self.pending, "put: rows are pending"
        self.pending, self.pending_rows = [columns], len(columns["tokens"])
        self.write(self.pending_rows, number)

    def write(self, n: int, number: int | None = None) -> None:
        """Write the first `n` pending rows as a shard, numbered `number` (default: the next)."""
        joined = {k: np.concatenate([p[k] for p in self.pending]) for k in self.pending[0]}
        part = {k: v[:n] for k, v in joined.items()}
        rest = {k: v[n:] for k, v in joined.items()}
        self.pending, self.pending_rows = ([rest] if len(rest["tokens"]) else []), self.pending_rows - n
        table = encode_rows(part, self.vocab_size)
        path = self.out_dir / f"shard-{len(self.shards) if number is None else number:05d}.arrow"
        tmp = path.with_suffix(".arrow.tmp")
        with naming(path), pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        tmp.replace(path)
        self.shards.append({"file": path.name, "rows": n, "sha256": sha256_file(path)})
        real_tokens = part["tokens"][part["segment_ids"] > 0]
        counts = np.bincount(real_tokens, minlength=len(self.counts))
        counts[: len(self.counts)] += self.counts
        self.counts, self.real, self.rows, self.columns = (
            counts,
            self.real + real_tokens.size,
            self.rows + n,
            sorted(part),
        )

    def close(self) -> dict[str, Any]:
        """Write the last shard; return this writer's part of a split (its shards and totals)."""
        if self.pending_rows:
            self.write(self.pending_rows)
        return {
            "shards": self.shards,
            "rows": self.rows,
            "tokens": int(self.real),
            "counts": self.counts.tolist(),
            "columns": self.columns,
        }

    def finish(self, meta: dict) -> dict:
        """Write the last shard, then manifest.json; return the manifest."""
        return write_manifest(self.out_dir, self.row_len, self.vocab_size, [self.close()], meta)


def write_manifest(out_dir: Path, row_len: int, vocab_size: int, parts: list[dict[str, Any]], meta: dict) -> dict:
    """manifest.json of a split written as `parts` (one per process): their shards, in the
    order of their numbers, and their totals. Shard files in `out_dir` that the manifest
    does not list (from an earlier run) are removed. Nothing in it says how many
    processes wrote the split: the bytes are the same however many did."""
    counts = np.zeros(max(len(p["counts"]) for p in parts), np.int64)
    for part in parts:  # a process that wrote no shard has no counts: [] reads back as float
        counts[: len(part["counts"])] += np.asarray(part["counts"], np.int64)
    rows, real = sum(p["rows"] for p in parts), sum(p["tokens"] for p in parts)
    shards = sorted((s for p in parts for s in p["shards"]), key=lambda s: int(s["file"].rsplit("-", 1)[1][:-6]))
    freqs = counts[counts > 0] / real
    if all("documents" in p for p in parts):
        meta = {**meta, "documents": sum(p["documents"] for p in parts)}
    manifest = {
        "schema_version": SCHEMA_VERSION,
        **meta,
        "row_len": row_len,
        "rows": rows,
        "tokens": int(real),
        "packing_efficiency": real / (rows * row_len),
        # Entropy of the token frequencies (nats): the loss of a model that ignores context.
        "unigram_entropy_nats": float(-(freqs * np.log(freqs)).sum()),
        "columns": next(p["columns"] for p in parts if p["columns"]),
        "token_dtype": token_type(vocab_size).name,  # on disk (stagelm.data.shard_format); rows read as int32
        "shards": shards,
    }
    listed = {s["file"] for s in shards}
    for stale in out_dir.glob("*.arrow"):
        if stale.name not in listed:
            stale.unlink()
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def write_split(
    out_dir: Path, columns: dict[str, np.ndarray], rows_per_shard: int, vocab_size: int, meta: dict
) -> dict:
    """Write `columns` (all rows at once) as shards plus manifest.json in `out_dir`; return the manifest."""
    writer = ShardWriter(out_dir, columns["tokens"].shape[1], rows_per_shard, vocab_size)
    writer.add(columns)
    return writer.finish(meta)


class CorpusPacker:
    """Concatenate-and-chunk (`pack_stream`) over batches of documents: each full row goes to
    `writer` as it forms and only the unfinished last row waits, so memory does not grow
    with the corpus. The rows are exactly `pack_stream`'s over all the documents at once."""

    def __init__(self, writer: ShardWriter, eos: int):
        self.writer, self.eos, self.row_len = writer, eos, writer.row_len
        self.tail = np.zeros(0, np.int32)  # tokens of the unfinished row
        self.tail_docs = np.zeros(0, np.int64)  # their document numbers
        self.documents = 0

    def add(self, docs: list[np.ndarray]) -> None:
        """Append documents given as token arrays (each gets its EOS here)."""
        if docs:
            lengths = np.array([len(d) + 1 for d in docs], np.int64)
            self.add_joined(np.concatenate([np.append(d, self.eos).astype(np.int32) for d in docs]), lengths)

    def add_joined(self, joined: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one array of their tokens, each already followed by its EOS."""
        if not len(lengths):
            return
        flat = np.concatenate([self.tail, joined])
        numbers = np.repeat(np.arange(self.documents, self.documents + len(lengths)), lengths)
        doc_of = np.concatenate([self.tail_docs, numbers])
        self.documents += len(lengths)
        cut = len(flat) // self.row_len * self.row_len
        if cut:
            self.writer.add(self.rows(flat[:cut], doc_of[:cut]))
        self.tail, self.tail_docs = flat[cut:], doc_of[cut:]

    def rows(self, tokens: np.ndarray, doc_of: np.ndarray) -> dict[str, np.ndarray]:
        segment_ids, positions = segment_layout(doc_of.reshape(-1, self.row_len))
        return {"tokens": tokens.reshape(-1, self.row_len), "segment_ids": segment_ids, "positions": positions}

    def close(self) -> dict[str, Any]:
        """Pad the last row and write it; return the writer's part, with the document count."""
        if len(self.tail):
            padded = self.row_len - len(self.tail)
            tokens = np.concatenate([self.tail, np.zeros(padded, np.int32)])
            self.writer.add(self.rows(tokens, np.concatenate([self.tail_docs, np.full(padded, -1)])))
            self.tail, self.tail_docs = self.tail[:0], self.tail_docs[:0]
        return {**self.writer.close(), "documents": self.documents}

    def finish(self, meta: dict) -> dict:
        """Pad the last row, write it, then the manifest (with the document count)."""
        w = self.writer
        return write_manifest(w.out_dir, w.row_len, w.vocab_size, [self.close()], meta)


def pack_corpus(chat: ChatFormat, batches: Iterable[list[str]], writer: ShardWriter) -> dict[str, Any]:
    """Encode and pack (a share of) a corpus split streamed as batches of texts; return the writer's part.
    Each document ends with the tokenizer's eos (and starts with its bos, where its text does)."""
    packer = CorpusPacker(writer, chat.eos)
    for texts in batches:
        packer.add_joined(*encode_joined(chat.tok, texts, chat.eos, chat.bos if chat.add_bos else None))
    return packer.close()


def pack_chats(chat: ChatFormat, conversations: list[list[dict]], row_len: int) -> tuple[dict[str, np.ndarray], int]:
    """(packed columns with loss_mask, conversation count) of chat conversations in the tokenizer's
    chat format (stagelm's, or a checkpoint's template), next-fit."""
    encoded = [chat.conversation(messages) for messages in conversations]
    docs = [np.asarray(ids, np.int32) for ids, _ in encoded]
    masks = [np.asarray(mask, np.int32) for _, mask in encoded]
    return pack_next_fit(docs, masks, row_len, chat.eos), len(docs)


def pack_buffer_bytes(rows_per_shard: int, row_len: int) -> int:
    """pack's shard of rows: up to four int32 columns, held about three times over while it is cut and written."""
    return 3 * 4 * 4 * rows_per_shard * row_len
