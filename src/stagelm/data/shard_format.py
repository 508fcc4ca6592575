"""The packed shard format: how a row is stored on disk, and read back.

A row as training sees it is a dict of `(row_len,)` int32 arrays: `tokens`,
`segment_ids` (1, 2, ... per document piece, 0 on padding), `positions` (restarting at
0 for each piece) and, in SFT rows, `loss_mask`. On disk an Arrow IPC shard stores
only what cannot be derived:

- `tokens`: the token ids, as uint16 when the vocabulary has at most 65,536 entries
  (uint32 otherwise);
- `starts`: the columns where a piece begins (0 first, then one after each document
  boundary inside the row), uint16 (uint32 for rows over 65,535 tokens);
- `length`: how many leading tokens are real; the rest of the row is padding;
- `loss_mask` (SFT only): one bit per token, `np.packbits` order.

So a token costs about 2 bytes (plus 2 per document start and 6 per row) where three
int32 columns cost 12; segment ids and positions are rebuilt per row on reading.
Padding sits only at the end of a row, which is how both packers lay rows out.
"""

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 2
UINT16_LIMIT = 1 << 16


def token_type(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= UINT16_LIMIT else np.uint32)


def index_type(row_len: int) -> np.dtype:
    return np.dtype(np.uint16 if row_len < UINT16_LIMIT else np.uint32)


def encode_rows(columns: dict[str, np.ndarray], vocab_size: int) -> pa.Table:
    """The Arrow table storing rows given as `(rows, row_len)` arrays (tokens, segment_ids[, loss_mask])."""
    tokens, seg = columns["tokens"], columns["segment_ids"]
    rows, row_len = tokens.shape
    real = seg > 0
    length = real.sum(axis=1)
    if not np.array_equal(real, np.arange(row_len) < length[:, None]):
        raise ValueError("padding must come only at the end of a row")
    first = np.zeros_like(real)
    first[:, 0] = True
    is_start = real & (first | (seg != np.roll(seg, 1, axis=1)))
    row_of, col_of = np.nonzero(is_start)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(np.bincount(row_of, minlength=rows), out=offsets[1:])
    index = index_type(row_len)
    table = {
        "tokens": pa.FixedSizeListArray.from_arrays(tokens.astype(token_type(vocab_size)).reshape(-1), row_len),
        "starts": pa.ListArray.from_arrays(pa.array(offsets), pa.array(col_of.astype(index))),
        "length": pa.array(length.astype(index)),
    }
    if "loss_mask" in columns:
        bits = np.packbits(columns["loss_mask"].astype(bool), axis=1)
        table["loss_mask"] = pa.FixedSizeListArray.from_arrays(bits.reshape(-1), bits.shape[1])
    return pa.table(table)


class ShardRows:
    """Rows of one shard read from its (memory-mapped) Arrow table, decoded one at a time."""

    def __init__(self, table: pa.Table, row_len: int):
        self.row_len = row_len
        self.tokens = flat_values(table["tokens"]).reshape(-1, row_len)
        starts = table["starts"].combine_chunks()
        self.offsets = starts.offsets.to_numpy()
        self.starts = starts.values.to_numpy()
        self.length = table["length"].to_numpy()
        self.mask = (
            flat_values(table["loss_mask"]).reshape(len(self.tokens), -1) if "loss_mask" in table.column_names else None
        )
        self.cols = np.arange(row_len)

    def __len__(self) -> int:
        return len(self.tokens)

    def row(self, i: int) -> dict[str, np.ndarray]:
        length = int(self.length[i])
        mark = np.zeros(self.row_len, np.int32)
        mark[self.starts[self.offsets[i] : self.offsets[i + 1]]] = 1
        segment_ids = np.cumsum(mark, dtype=np.int32)
        positions = (self.cols - np.maximum.accumulate(mark * self.cols)).astype(np.int32)
        segment_ids[length:] = 0
        positions[length:] = 0
        row = {"tokens": self.tokens[i].astype(np.int32), "segment_ids": segment_ids, "positions": positions}
        if self.mask is not None:
            row["loss_mask"] = np.unpackbits(self.mask[i], count=self.row_len).astype(np.int32)
        return row


def flat_values(column: pa.ChunkedArray) -> np.ndarray:
    """The values of a fixed-size-list column as one flat numpy array (zero-copy for one chunk)."""
    chunks = [c.values.to_numpy() for c in column.chunks]
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
