"""The pack stage's library: tokenize documents and pack them into fixed-length rows.

A row holds `seq_len + 1` tokens so that a training step sees `seq_len` inputs and
their `seq_len` shifted targets. Columns, each a fixed-size list per row:

- `tokens`: token ids, `<|pad|>` (0) after the last document;
- `segment_ids`: 1, 2, ... for the documents (or pieces of one) inside the row, 0 for padding;
- `positions`: the position within the segment, restarting at 0 for each segment;
- `loss_mask` (SFT only): 1 on the tokens to train on (assistant text and its end token).

Every document is followed by `<|eos|>`. The corpus splits are packed by
concatenate-and-chunk (a document may straddle rows, nearly no padding); SFT
conversations are packed next-fit so that a conversation stays whole within a row
unless it is longer than a row. Either way the non-pad tokens, read row by row, are
exactly the documents' tokens plus their EOSes, in order.
"""

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from stagelm.files import sha256_file, write_json
from stagelm.tokenizer import EOS, chat_segments, encode_batch, special_id

SCHEMA_VERSION = 1


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
    killed run never leaves a manifest over partial shards. Memory: one shard of rows."""

    def __init__(self, out_dir: Path, row_len: int, rows_per_shard: int):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.row_len, self.rows_per_shard = out_dir, row_len, rows_per_shard
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

    def write(self, n: int) -> None:
        joined = {k: np.concatenate([p[k] for p in self.pending]) for k in self.pending[0]}
        part = {k: v[:n] for k, v in joined.items()}
        rest = {k: v[n:] for k, v in joined.items()}
        self.pending, self.pending_rows = ([rest] if len(rest["tokens"]) else []), self.pending_rows - n
        table = pa.table({k: pa.FixedSizeListArray.from_arrays(v.reshape(-1), self.row_len) for k, v in part.items()})
        path = self.out_dir / f"shard-{len(self.shards):05d}.arrow"
        tmp = path.with_suffix(".arrow.tmp")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
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

    def finish(self, meta: dict) -> dict:
        """Write the last shard, then manifest.json; return the manifest."""
        if self.pending_rows:
            self.write(self.pending_rows)
        freqs = self.counts[self.counts > 0] / self.real
        manifest = {
            "schema_version": SCHEMA_VERSION,
            **meta,
            "row_len": self.row_len,
            "rows": self.rows,
            "tokens": int(self.real),
            "packing_efficiency": self.real / (self.rows * self.row_len),
            # Entropy of the token frequencies (nats): the loss of a model that ignores context.
            "unigram_entropy_nats": float(-(freqs * np.log(freqs)).sum()),
            "columns": self.columns,
            "shards": self.shards,
        }
        write_json(self.out_dir / "manifest.json", manifest)
        return manifest


def write_split(out_dir: Path, columns: dict[str, np.ndarray], rows_per_shard: int, meta: dict) -> dict:
    """Write `columns` (all rows at once) as shards plus manifest.json in `out_dir`; return the manifest."""
    writer = ShardWriter(out_dir, columns["tokens"].shape[1], rows_per_shard)
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
        if not docs:
            return
        lengths = [len(d) + 1 for d in docs]
        flat = np.concatenate([self.tail, *(np.append(d, self.eos).astype(np.int32) for d in docs)])
        numbers = np.repeat(np.arange(self.documents, self.documents + len(docs)), lengths)
        doc_of = np.concatenate([self.tail_docs, numbers])
        self.documents += len(docs)
        cut = len(flat) // self.row_len * self.row_len
        if cut:
            self.writer.add(self.rows(flat[:cut], doc_of[:cut]))
        self.tail, self.tail_docs = flat[cut:], doc_of[cut:]

    def rows(self, tokens: np.ndarray, doc_of: np.ndarray) -> dict[str, np.ndarray]:
        segment_ids, positions = segment_layout(doc_of.reshape(-1, self.row_len))
        return {"tokens": tokens.reshape(-1, self.row_len), "segment_ids": segment_ids, "positions": positions}

    def finish(self, meta: dict) -> dict:
        """Pad the last row, write it, then the manifest (with the document count)."""
        if len(self.tail):
            padded = self.row_len - len(self.tail)
            tokens = np.concatenate([self.tail, np.zeros(padded, np.int32)])
            self.writer.add(self.rows(tokens, np.concatenate([self.tail_docs, np.full(padded, -1)])))
        return self.writer.finish({**meta, "documents": self.documents})


def pack_corpus(tok: Tokenizer, batches: Iterable[list[str]], writer: ShardWriter, meta: dict) -> dict:
    """Encode and pack a corpus split streamed as batches of texts; return its manifest."""
    packer = CorpusPacker(writer, special_id(tok, EOS))
    for texts in batches:
        packer.add(encode_batch(tok, texts))
    return packer.finish(meta)


def pack_chats(tok: Tokenizer, conversations: list[list[dict]], row_len: int) -> tuple[dict[str, np.ndarray], int]:
    """(packed columns with loss_mask, conversation count) of chat conversations, next-fit."""
    encoded = [chat_segments(tok, messages) for messages in conversations]
    docs = [np.asarray(ids, np.int32) for ids, _ in encoded]
    masks = [np.asarray(mask, np.int32) for _, mask in encoded]
    return pack_next_fit(docs, masks, row_len, special_id(tok, EOS)), len(docs)
