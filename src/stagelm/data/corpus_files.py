"""Corpus files read as batches of documents: txt, jsonl / json, csv and parquet, plain or compressed.

- `.txt`: one document per blank-line-separated paragraph;
- `.jsonl` / `.json`: one object per line, text in `data.text_field` (a `.json` file holding
  one array is read whole);
- `.csv` and `.parquet`: column `data.text_field`;

each optionally compressed (`.gz`, `.zst`, `.bz2`); files are read in sorted path order, a
batch at a time, so a file of any size costs one batch of memory. Every read failure is one
line naming the file (and the line, where there is one).
"""

import codecs
import csv
import glob
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm.infra.errors import StagelmError

KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


COMPRESSIONS = (".gz", ".zst", ".bz2")  # pyarrow decompresses these while reading


BATCH_DOCUMENTS = 4096  # documents per batch between reader and writer


READ_CHUNK = 4 << 20  # bytes read at a time from a text file


def file_kind(path: Path) -> str | None:
    """'text', 'json', 'csv' or 'parquet' by the suffix under any compression suffix; None for others."""
    name = path.name[: -len(path.suffix)] if path.suffix in COMPRESSIONS else path.name
    kind = KINDS.get(Path(name).suffix)
    return None if kind == "parquet" and name != path.name else kind


def match_files(pattern: str, key: str = "data.source") -> list[Path]:
    """The corpus files a path, directory or glob names, sorted by path; all of one kind. Errors
    name `key`, the params key that gave the pattern."""
    path = Path(pattern)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if not hidden(p.relative_to(path)))
    else:  # glob leaves out hidden names unless the pattern spells them
        found = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    found = [p for p in found if p.is_file() and file_kind(p)]
    given = f"'files:{pattern}'" if key == "data.source" else repr(pattern)
    if not found:
        raise StagelmError(
            f"{key}: {given} matches no .txt, .jsonl, .json, .csv or .parquet file "
            f"(optionally {', '.join(COMPRESSIONS)}); check the path or glob"
        )
    kinds = {file_kind(p) for p in found}
    if len(kinds) > 1:
        raise StagelmError(f"{key}: {given} mixes file kinds {sorted(kinds)}; use one kind")
    return found


def hidden(relative: Path) -> bool:
    """Whether a path below a corpus folder is hidden (`.ipynb_checkpoints/`, `.git/`, `.cache`): not corpus."""
    return any(part.startswith(".") for part in relative.parts)


def read_file(path: Path, field: str) -> Iterator[list[str]]:
    """Batches of the documents in one corpus file; any read failure is one line naming the file."""
    kind = file_kind(path)
    readers = {"text": read_text, "json": read_json_rows, "csv": read_csv, "parquet": read_parquet}
    try:
        seen = 0
        for batch in readers[kind](path, field):
            for i, text in enumerate(batch):
                if "\0" in text:
                    raise StagelmError(
                        f"{path}: document {seen + i + 1} holds a NUL character (offset {text.index(chr(0))}); "
                        "remove it from the file"
                    )
            seen += len(batch)
            yield batch
    except StagelmError:
        raise
    except FileNotFoundError:
        raise StagelmError(f"{path}: vanished while the corpus was being read; restore it and rerun") from None
    except (OSError, EOFError, ValueError, pa.ArrowException) as err:
        raise StagelmError(f"{path}: cannot be read as {kind}: {first_line(err)}; fix or remove the file") from None


def open_stream(path: Path) -> io.BufferedReader:
    """A buffered binary stream of the file, decompressed by its suffix (.gz, .zst, .bz2)."""
    return io.BufferedReader(pa.input_stream(str(path), compression="detect"), buffer_size=1 << 20)


def read_text(path: Path, field: str) -> Iterator[list[str]]:
    """Paragraphs (text between blank lines) as documents; `\\r\\n` read as `\\n`, a UTF-8 byte
    order mark at the start dropped, a NUL byte refused (a binary file, or one in UTF-16)."""
    del field  # a text file has no fields
    utf8 = codecs.getincrementaldecoder("utf-8-sig")()
    carry, pending, batch, offset = "", [], [], 0
    with open_stream(path) as f:
        while True:
            chunk = f.read(READ_CHUNK)
            if b"\0" in chunk:
                raise StagelmError(
                    f"{path}: a NUL byte at byte {offset + chunk.index(0)}; a text corpus holds UTF-8 text, "
                    "not binary or UTF-16: re-encode or remove the file"
                )
            try:
                text = carry + utf8.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise StagelmError(
                    f"{path}: not UTF-8 text (byte {offset + err.start}); re-encode it as UTF-8"
                ) from None
            offset += len(chunk)
            body = text.rstrip("\r\n") if chunk else text  # a blank line may straddle two chunks
            carry = text[len(body) :]
            parts = body.replace("\r\n", "\n").split("\n\n")
            pending.append(parts[0])
            if len(parts) > 1:
                batch.append("".join(pending))
                batch.extend(parts[1:-1])
                pending = [parts[-1]]
            if len(batch) >= BATCH_DOCUMENTS or not chunk:
                if not chunk:
                    batch.append("".join(pending))
                yield [d.strip("\n") for d in batch]
                batch = []
            if not chunk:
                return


def read_json_rows(path: Path, field: str) -> Iterator[list[str]]:
    """Field `field` of each object: one per line, or the elements of a file holding one JSON array."""
    with open_stream(path) as f:
        if f.peek(4096).lstrip()[:1] == b"[":  # a JSON array: read whole (use .jsonl to stream)
            try:
                rows = json.loads(f.read())
            except ValueError as err:
                raise StagelmError(f"{path}: not valid JSON ({first_line(err)}); fix it or write it as jsonl") from None
            lines: Iterable[tuple[int, Any]] = enumerate(rows, 1)
        else:
            lines = ((number, line) for number, line in enumerate(f, 1) if line.strip())
        batch = []
        for number, row in lines:
            if isinstance(row, bytes):
                row = row.removeprefix(codecs.BOM_UTF8) if number == 1 else row
                try:
                    row = json.loads(row)
                except UnicodeDecodeError:
                    raise StagelmError(f"{path}:{number}: not UTF-8 text; re-encode the file as UTF-8") from None
                except ValueError:
                    raise StagelmError(f"{path}:{number}: not a JSON object; fix the line or remove it") from None
            batch.append(row_text(row, field, f"{path}:{number}"))
            if len(batch) == BATCH_DOCUMENTS:
                yield batch
                batch = []
        yield batch


def row_text(row: Any, field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise StagelmError(f"{where}: not a JSON object; each row must be an object with a {field!r} field")
    if field not in row:
        raise StagelmError(f"data.text_field: {where} has no column {field!r}; columns: {sorted(row)}")
    text = row[field]
    if text is not None and not isinstance(text, str):
        raise StagelmError(f"data.text_field: column {field!r} of {where} is not text")
    return require_text(text or "", where)


def require_text(value: str, where: str) -> str:
    """`value`, unless it holds a lone surrogate: JSON's `\\ud800`-`\\udfff` escapes decode to
    code points UTF-8 cannot carry, so no tokenizer or Parquet file can take them."""
    try:
        value.encode()
    except UnicodeEncodeError as err:
        raise StagelmError(
            f"{where}: holds a lone surrogate escape (\\u{ord(value[err.start]):04x} at character {err.start}), "
            "not text; fix or remove it"
        ) from None
    return value


def read_csv(path: Path, field: str) -> Iterator[list[str]]:
    """Column `field` of a CSV file with a header row, streamed by Python's `csv` in strict
    mode: a quote left open says where it opened instead of swallowing the rest of the file."""
    csv.field_size_limit(1 << 30)  # a document may be long; the default cap is 128 KiB
    with io.TextIOWrapper(open_stream(path), encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, strict=True)
        start = 1
        try:
            names = next(reader, [])
            if field not in names:
                raise StagelmError(f"data.text_field: {path} has no column {field!r}; columns: {names}")
            column, batch, start = names.index(field), [], reader.line_num + 1
            for row in reader:
                if len(row) != len(names):
                    raise StagelmError(
                        f"{path}:{start}: {len(row)} fields where the header has {len(names)} "
                        "(a quote left open?); fix the row"
                    )
                batch.append(row[column])
                start = reader.line_num + 1
                if len(batch) == BATCH_DOCUMENTS:
                    yield batch
                    batch = []
        except csv.Error as err:
            raise StagelmError(f"{path}:{start}: not valid CSV ({err}; a quote left open?); fix the row") from None
        yield batch


def read_parquet(path: Path, field: str) -> Iterator[list[str]]:
    """Column `field` of a Parquet file, a batch of rows at a time."""
    with pq.ParquetFile(str(path), pre_buffer=False) as f:
        schema = f.schema_arrow
        if field not in schema.names:
            raise StagelmError(f"data.text_field: {path} has no column {field!r}; columns: {schema.names}")
        if not pa.types.is_string(schema.field(field).type) and not pa.types.is_large_string(schema.field(field).type):
            raise StagelmError(f"data.text_field: column {field!r} of {path} is not text")
        for batch in f.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[field], use_threads=False):
            yield [t or "" for t in batch.column(0).to_pylist()]


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
