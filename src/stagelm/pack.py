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


def write_split(out_dir: Path, columns: dict[str, np.ndarray], rows_per_shard: int, meta: dict) -> dict:
    """Write `columns` as Arrow IPC shards plus manifest.json in `out_dir`; return the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n_rows, row_len = columns["tokens"].shape
    shards = []
    for index, start in enumerate(range(0, n_rows, rows_per_shard)):
        part = {k: v[start : start + rows_per_shard] for k, v in columns.items()}
        table = pa.table({k: pa.FixedSizeListArray.from_arrays(v.reshape(-1), row_len) for k, v in part.items()})
        path = out_dir / f"shard-{index:05d}.arrow"
        tmp = path.with_suffix(".arrow.tmp")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        tmp.replace(path)
        shards.append({"file": path.name, "rows": len(part["tokens"]), "sha256": sha256_file(path)})
    real_tokens = columns["tokens"][columns["segment_ids"] > 0]
    real = int(real_tokens.size)
    counts = np.bincount(real_tokens)
    freqs = counts[counts > 0] / real
    manifest = {
        "schema_version": SCHEMA_VERSION,
        **meta,
        "row_len": row_len,
        "rows": n_rows,
        "tokens": real,
        "packing_efficiency": real / (n_rows * row_len),
        # Entropy of the token frequencies (nats): the loss of a model that ignores context.
        "unigram_entropy_nats": float(-(freqs * np.log(freqs)).sum()),
        "columns": sorted(columns),
        "shards": shards,
    }
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def pack_corpus(tok: Tokenizer, texts: list[str], row_len: int) -> tuple[dict[str, np.ndarray], int]:
    """(packed columns, document count) of a corpus split, concatenate-and-chunk."""
    docs = encode_batch(tok, texts)
    return pack_stream(docs, row_len, special_id(tok, EOS)), len(docs)


def pack_chats(tok: Tokenizer, conversations: list[list[dict]], row_len: int) -> tuple[dict[str, np.ndarray], int]:
    """(packed columns with loss_mask, conversation count) of chat conversations, next-fit."""
    encoded = [chat_segments(tok, messages) for messages in conversations]
    docs = [np.asarray(ids, np.int32) for ids, _ in encoded]
    masks = [np.asarray(mask, np.int32) for _, mask in encoded]
    return pack_next_fit(docs, masks, row_len, special_id(tok, EOS)), len(docs)
