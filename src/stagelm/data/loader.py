"""Read packed splits: manifest checks and a Grain loader of numpy batches.

`PackedRows` verifies a split directory against its manifest (schema, every shard's
sha256), memory-maps its Arrow shards and decodes a row when it is asked for
(`stagelm.data.shard_format`). `batch_iterator` builds the Grain pipeline:
a seeded shuffle that changes every epoch, repetition, this process's share of the
rows (for multi-host runs) and batching. Its iterator is
checkpointable: `get_state()` is a small JSON-able dict, and `set_state()` on a fresh
iterator resumes exactly where the saved one was.
"""

import bisect
from pathlib import Path
from typing import Any

import grain
import numpy as np
import pyarrow as pa

from stagelm.data.shard_format import SCHEMA_VERSION, ShardRows
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json, sha256_file


def read_manifest(split_dir: str | Path) -> dict[str, Any]:
    path = Path(split_dir) / "manifest.json"
    if not path.is_file():
        raise StagelmError(f"{path}: manifest missing; run `dvc repro pack` (or `dvc pull pack`)")
    try:
        manifest = read_json(path)
    except ValueError:
        raise StagelmError(f"{path}: not valid JSON; rerun `dvc repro pack`") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise StagelmError(
            f"{path}: schema_version {manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}; "
            "repack with `dvc repro pack`"
        )
    return manifest


def verify_shards(split_dir: str | Path, manifest: dict[str, Any]) -> None:
    """Fail naming the first shard that is missing or whose sha256 differs from the manifest."""
    for shard in manifest["shards"]:
        path = Path(split_dir) / shard["file"]
        if not path.is_file():
            raise StagelmError(
                f"{path}: shard listed in manifest.json is missing; run `dvc checkout --force {split_dir}` "
                "or `dvc repro pack`"
            )
        if sha256_file(path) != shard["sha256"]:
            raise StagelmError(
                f"{path}: sha256 differs from manifest.json (corrupt or edited); rebuild it with `dvc repro -f pack`"
            )


class PackedRows:
    """Random access to the rows of a packed split: row i is a dict of (row_len,) int32 arrays."""

    def __init__(self, split_dir: str | Path, verify: bool = True):
        self.dir = Path(split_dir)
        self.manifest = read_manifest(self.dir)
        if verify:
            verify_shards(self.dir, self.manifest)
        self.columns = self.manifest["columns"]
        self.shards: list[ShardRows] = []
        self.starts: list[int] = []
        total = 0
        for shard in self.manifest["shards"]:
            table = pa.ipc.open_file(pa.memory_map(str(self.dir / shard["file"]))).read_all()
            self.shards.append(ShardRows(table, self.manifest["row_len"]))
            self.starts.append(total)
            total += shard["rows"]
        self.rows = total

    def __len__(self) -> int:
        return self.rows

    def require_tokenizer(self, tokenizer: Path) -> None:
        """Fail unless this split was packed with `tokenizer` (a tokenizer.json: a model's or the pipeline's)."""
        if self.manifest["tokenizer_sha256"] != sha256_file(tokenizer):
            raise StagelmError(f"{self.dir}: packed with another tokenizer than {tokenizer}; rerun `dvc repro`")

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard = bisect.bisect_right(self.starts, index) - 1
        local = index - self.starts[shard]
        return self.shards[shard].row(local)

    def all_rows(self) -> dict[str, np.ndarray]:
        """Every row, in order, as (rows, row_len) arrays (decoded row by row: for small splits)."""
        rows = [self[i] for i in range(self.rows)]
        return {c: np.stack([r[c] for r in rows]) for c in self.columns}


class MixedRows:
    """Several packed splits read as one (row i of the first, then of the next, ...).

    Splits must share the row length. A split without `loss_mask` (the corpus) trains on
    every token, so it gets a mask of ones when another split (SFT) carries one.
    """

    def __init__(self, splits: list[PackedRows], counts: list[int | None] | None = None):
        """`counts`: how many leading rows of each split to use (None: all of it)."""
        widths = {s.manifest["row_len"] for s in splits}
        if len(widths) != 1:
            raise StagelmError(
                f"{', '.join(str(s.dir) for s in splits)}: row lengths differ ({sorted(widths)}); repack"
            )
        self.splits = splits
        self.dir = splits[0].dir
        self.manifest = splits[0].manifest
        self.columns = sorted({c for s in splits for c in s.columns})
        counts = counts or [None] * len(splits)
        sizes = [len(s) if n is None else min(n, len(s)) for s, n in zip(splits, counts, strict=True)]
        self.starts = list(np.cumsum([0] + sizes[:-1]))
        self.rows = sum(sizes)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        which = bisect.bisect_right(self.starts, index) - 1
        row = self.splits[which][index - self.starts[which]]
        if "loss_mask" in self.columns and "loss_mask" not in row:
            row = {**row, "loss_mask": np.ones_like(row["tokens"])}
        return row


def batch_iterator(
    rows: PackedRows | MixedRows,
    batch_size: int,
    seed: int,
    *,
    shard_index: int = 0,
    shard_count: int = 1,
    shuffle: bool = True,
    num_epochs: int | None = None,
) -> grain.DatasetIterator:
    """A checkpointable iterator of dicts of (batch_size, row_len) numpy arrays.

    The rows are shuffled (a new order each epoch) and repeated before they are split
    between processes: process p takes rows p, p + shard_count, ... of that one stream.
    So the processes' batches together hold exactly the rows that one process would
    batch for the same global batch, whatever the process count, and every process's
    iterator state is the same position in the stream.
    """
    if len(rows) < shard_count:
        raise StagelmError(f"{rows.dir}: {len(rows)} rows cannot feed {shard_count} processes; pack more data")
    ds = grain.MapDataset.source(rows)
    if shuffle:
        ds = ds.shuffle(seed)
    ds = ds.repeat(num_epochs)[shard_index::shard_count]
    ds = ds.batch(batch_size, drop_remainder=num_epochs is None)
    return iter(ds.to_iter_dataset())
