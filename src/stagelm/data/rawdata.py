"""Read the download stage's output (`data/raw/`), checked against its manifest."""

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json, sha256_file


def read_raw(raw_dir: str | Path, name: str) -> pa.Table:
    """Table `name` (corpus_train, corpus_val, sft, rl, eval) of the raw data, sha256-checked."""
    return pq.read_table(raw_file(raw_dir, name))


def iter_column(
    raw_dir: str | Path, name: str, column: str, batch_rows: int = 8192, share: tuple[int, int] = (0, 1)
) -> Iterator[list]:
    """Column `column` of table `name`, `batch_rows` rows at a time: memory bounded by one batch
    (pyarrow's pre-buffering would read the whole file ahead: 385 MB for a 376 MB file).

    `share=(p, n)` reads only the p-th of n contiguous, near-equal ranges of rows (what
    process p of n packs); only the row groups overlapping it are read."""
    with pq.ParquetFile(raw_file(raw_dir, name), pre_buffer=False) as f:
        p, n = share
        total = f.metadata.num_rows
        start, stop = total * p // n, total * (p + 1) // n
        groups, first = [], 0  # row groups overlapping [start, stop), and the first one's first row
        offset = 0
        for g in range(f.num_row_groups):
            size = f.metadata.row_group(g).num_rows
            if offset < stop and offset + size > start:
                first = offset if not groups else first
                groups.append(g)
            offset += size
        if not groups:
            return
        row = first
        for batch in f.iter_batches(batch_size=batch_rows, row_groups=groups, columns=[column], use_threads=False):
            lo, hi = max(start - row, 0), min(stop - row, batch.num_rows)
            row += batch.num_rows
            if hi > lo:
                yield batch.column(0).slice(lo, hi - lo).to_pylist()


def raw_file(raw_dir: str | Path, name: str) -> Path:
    """The file of table `name`, checked against the manifest's sha256."""
    raw_dir = Path(raw_dir)
    manifest_path = raw_dir / "manifest.json"
    if not manifest_path.is_file():
        raise StagelmError(f"{manifest_path}: missing; run `dvc repro download` (or `dvc pull download`)")
    entry = read_json(manifest_path)["files"].get(name)
    if entry is None:
        raise StagelmError(f"{manifest_path}: lists no {name!r} file; rerun `dvc repro download`")
    path = raw_dir / entry["file"]
    if not path.is_file():
        raise StagelmError(f"{path}: missing; run `dvc checkout --force {raw_dir}` or `dvc repro download`")
    if sha256_file(path) != entry["sha256"]:
        raise StagelmError(
            f"{path}: sha256 differs from {manifest_path} (corrupt or edited); rebuild it with `dvc repro -f download`"
        )
    return path
