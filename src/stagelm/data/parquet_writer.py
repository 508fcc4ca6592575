"""Parquet files of the download stage, written to `<name>.tmp` and renamed by the stage when all are done."""

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm.infra.files import sha256_file

ROW_GROUP_CHARS = 16 << 20  # characters per Parquet row group of a written corpus split (memory: two of them)


class TextWriter:
    """One Parquet file of a `text` column, written (to `<path>.tmp`) in row groups of about
    ROW_GROUP_CHARS characters as documents arrive."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.writer = pq.ParquetWriter(self.tmp, pa.schema([("text", pa.string())]))
        self.pending: list[str] = []
        self.pending_chars = self.rows = self.chars = 0

    def add(self, texts: list[str]) -> None:
        self.pending.extend(texts)
        added = sum(map(len, texts))
        self.pending_chars += added
        self.chars += added
        self.rows += len(texts)
        if self.pending_chars >= ROW_GROUP_CHARS:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.table({"text": self.pending}))
        self.pending, self.pending_chars = [], 0

    def close(self) -> dict[str, Any]:
        """Finish the temporary file; its entry names the final file."""
        self.flush()
        self.writer.close()
        return {"file": self.path.name, "rows": self.rows, "sha256": sha256_file(self.tmp), "chars": self.chars}

    def abort(self) -> None:
        self.writer.close()  # a no-op once closed


def write_table(path: Path, table: pa.Table) -> dict[str, Any]:
    """Write `table` to `<path>.tmp`; its entry names the final file."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    return {"file": path.name, "rows": table.num_rows, "sha256": sha256_file(tmp)}
