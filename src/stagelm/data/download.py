"""The download stage's library: read a corpus and task sets, split, write Parquet.

`data.source` picks where the corpus comes from:

- `synthetic`: generated from `data.seed` (see `stagelm.data.synthetic`);
- `files:<path, dir or glob>`: `.txt` (one document per blank-line-separated paragraph),
  `.jsonl` / `.json` (one object per line, text in `data.text_field`; a `.json` file
  holding one array is read whole), `.csv` and `.parquet` (column `data.text_field`),
  each optionally compressed (`.gz`, `.zst`, `.bz2`); files are read in sorted path order;
- `hf:<dataset id>` through `datasets` (streamed, pinned by `data.hf_revision`), or
  `hf:<local dataset dir>` for a dataset on disk (streamed too).

Documents stream through in batches: a file source of any size costs one batch and
one Parquet row group of memory. Blank documents are dropped and `data.max_documents`
caps the rest. The validation split of a file or hub corpus is chosen per document by
a hash of `data.seed` and its text, so it does not depend on the reading order and
adding files never moves an old document between splits (the same text always lands
in the same split). The synthetic corpus keeps its seeded choice of documents.

Task sets come from `data.sft_files`, `data.rl_files` and `data.eval_files` when set,
and from the synthetic task families otherwise (the manifest says which).
"""

import codecs
import csv
import glob
import hashlib
import io
import itertools
import json
import math
import random
import shutil
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm.data import synthetic
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import sha256_file, write_json
from stagelm.infra.memory import gib, host_available, require_memory
from stagelm.pipeline.config import DataConfig
from stagelm.tasks import FAMILIES, Task, select, spec_problem

KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSIONS = (".gz", ".zst", ".bz2")  # pyarrow decompresses these while reading
HUB_HOST = ("huggingface.co", 443)
BATCH_DOCUMENTS = 4096  # documents per batch between reader and writer
ROW_GROUP_CHARS = 16 << 20  # characters per Parquet row group of a written corpus split (memory: two of them)
READ_CHUNK = 4 << 20  # bytes read at a time from a text file


# --- the stage ------------------------------------------------------------------------


# Measured on the default synthetic corpus: Parquet holds it in 0.36 byte a character; the
# estimate rounds up. Python holds a document as a str (49 bytes and one a character, for
# ASCII) in three lists (the corpus, then its split): 49 + 3 × 8 bytes beside its characters.
PARQUET_BYTES_PER_CHAR = 0.5
STR_OVERHEAD = 49 + 3 * 8
SAMPLE_DOCUMENTS = 256


def synthetic_corpus_bytes(cfg: DataConfig) -> tuple[int, int]:
    """(bytes of memory, bytes on disk) the synthetic corpus of `cfg` will take: the mean
    document length of a small sample from the same generator, times `data.num_documents`.
    The corpus is generated whole in memory before it is written (the task sets are drawn
    from the same stream after it)."""
    families = select(cfg.families, "data.families")
    sample = synthetic.generate(cfg.seed, SAMPLE_DOCUMENTS, 0, 0, 1, families)["corpus"]
    mean = sum(len(d) for d in sample) / max(len(sample), 1)
    return int(cfg.num_documents * (mean + STR_OVERHEAD)), int(cfg.num_documents * mean * PARQUET_BYTES_PER_CHAR)


def require_synthetic_room(cfg: DataConfig, out_dir: Path) -> None:
    """Refuse, naming data.num_documents, a synthetic corpus that the memory (with the headroom
    the other checks keep) or the free disk under `out_dir` cannot hold."""
    memory, disk = synthetic_corpus_bytes(cfg)
    what = f"{cfg.num_documents:,} synthetic documents"
    require_memory(memory, "data.num_documents", f"generating {what} in memory", have=host_available())
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if disk > free:
        raise StagelmError(
            f"data.num_documents: {what} need about {gib(disk)} on disk, but {existing} has {gib(free)} free; lower it"
        )


def write_download(cfg: DataConfig, out_dir: Path) -> tuple[dict[str, Any], list[Path]]:
    """Stream the corpus of `data.source` into `out_dir` (Parquet per split and task set,
    manifest.json last); return the manifest and the input files read (none for synthetic/hf).

    Everything is written to temporary files first: a bad input leaves the folder as it
    was, and a run killed while renaming leaves no manifest, so nothing looks done."""
    is_synthetic = cfg.source == "synthetic"
    families = select(cfg.families, "data.families")
    if is_synthetic:
        require_synthetic_room(cfg, out_dir)
    generated = synthetic.generate(
        cfg.seed, cfg.num_documents if is_synthetic else 0, cfg.num_sft, cfg.num_rl, cfg.num_eval, families
    )
    sets, origin = task_sets(cfg, generated)  # small, and read first: their errors come before a long read
    if is_synthetic:
        desc, inputs = f"synthetic(seed={cfg.seed}, num_documents={cfg.num_documents})", []
    else:
        batches, desc, inputs = source_batches(cfg)  # opens the source: a wrong name fails here
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {name: TextWriter(out_dir / f"{name}.parquet") for name in ("corpus_train", "corpus_val")}
    try:
        if is_synthetic:
            train, val = split_documents(generated["corpus"], cfg.val_fraction, cfg.seed)
            splits["corpus_train"].add(train)
            splits["corpus_val"].add(val)
        else:
            key = cfg.seed.to_bytes(8, "little")
            for docs in capped(batches, cfg.max_documents):
                val = [in_val(d, key, cfg.val_fraction) for d in docs]
                splits["corpus_train"].add([d for d, v in zip(docs, val, strict=True) if not v])
                splits["corpus_val"].add([d for d, v in zip(docs, val, strict=True) if v])
            check_split(cfg, splits["corpus_train"].rows, splits["corpus_val"].rows)
        files = {name: writer.close() for name, writer in splits.items()}
        for name in ("sft", "rl", "eval"):
            files[name] = write_table(out_dir / f"{name}.parquet", pa.Table.from_pylist(sets[name]))
        (out_dir / "manifest.json").unlink(missing_ok=True)  # from here until the new one: not done
        for name, entry in files.items():
            (out_dir / f"{name}.parquet.tmp").replace(out_dir / entry["file"])
    finally:
        for writer in splits.values():
            writer.abort()
        for tmp in out_dir.glob("*.parquet.tmp"):
            tmp.unlink()
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
    manifest = {
        "schema_version": 1,
        "source": desc,
        "data_seed": cfg.seed,
        "task_sets": origin,
        "documents": {"train": files["corpus_train"]["rows"], "val": files["corpus_val"]["rows"]},
        "files": {name: {k: v for k, v in f.items() if k != "chars"} for name, f in files.items()},
        "families": {name: count_families(sets[name]) for name in ("sft", "rl", "eval")},
        "corpus_characters": {"train": files["corpus_train"]["chars"], "val": files["corpus_val"]["chars"]},
    }
    write_json(out_dir / "manifest.json", manifest)
    return manifest, inputs


def check_split(cfg: DataConfig, train: int, val: int) -> None:
    if train + val == 0:
        raise StagelmError(f"data.source: {cfg.source!r} holds no non-empty documents; point it at text")
    if not train or not val:
        raise StagelmError(
            f"data.val_fraction: {cfg.val_fraction} of {train + val} document(s) left the "
            f"{'val' if train else 'train'} split empty; change it or add documents"
        )


def source_batches(cfg: DataConfig) -> tuple[Iterator[list[str]], str, list[Path]]:
    """(batches of documents, a description of the source, its files) for a files: or hf: source."""
    scheme, _, arg = cfg.source.partition(":")
    if scheme == "files" and arg:
        files = match_files(arg)
        return (docs for path in files for docs in read_file(path, cfg.text_field)), f"files:{arg}", files
    if scheme == "hf" and arg:
        return hf_batches(arg, cfg), f"hf:{arg}@{cfg.hf_revision}/{cfg.hf_split}", []
    raise StagelmError(
        f"data.source: unknown source {cfg.source!r}; use 'synthetic', 'files:<path or glob>' or 'hf:<dataset id>'"
    )


def capped(batches: Iterable[list[str]], limit: int | None) -> Iterator[list[str]]:
    """The non-blank documents of `batches`, the first `limit` of them when a limit is set."""
    left = limit
    for batch in batches:
        docs = [d for d in batch if d and not d.isspace()]
        if left is not None:
            docs, left = docs[:left], left - min(left, len(docs))
        if docs:
            yield docs
        if left == 0:
            return


def in_val(text: str, key: bytes, fraction: float) -> bool:
    """Whether a document belongs to the val split: a keyed hash of its text, uniform in [0, 1)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


def split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, val) of the synthetic corpus: a seeded choice of ceil(fraction·n) documents for val, order kept."""
    if len(docs) < 2:
        raise StagelmError(f"data.source: {len(docs)} document(s) cannot be split into train and val; add documents")
    n_val = min(len(docs) - 1, max(1, math.ceil(val_fraction * len(docs))))
    val_idx = set(random.Random(seed).sample(range(len(docs)), n_val))
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


# --- reading files --------------------------------------------------------------------


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


# --- the hub and local datasets -------------------------------------------------------


def hf_batches(name: str, cfg: DataConfig) -> Iterator[list[str]]:
    """Column `data.text_field` of a streamed `datasets` dataset: a local dataset dir or a pinned hub id."""
    import datasets

    where = f"hf:{name}"
    if cfg.hf_revision is None:  # a dataset on disk (under data.inputs): no hub, no pin
        if not Path(name).is_dir():
            raise StagelmError(
                f"data.source: {where}: no such local dataset folder; give a folder under data.inputs, "
                f"or pin a hub dataset with data.hf_revision (a commit, tag or branch)"
            )
        kwargs = {}
    elif not hub_reachable():
        raise StagelmError(
            f"data.source: the Hugging Face hub is unreachable, so 'hf:{name}' cannot be read; "
            "download it elsewhere and use 'hf:<local dir>' or 'files:<glob>'"
        )
    else:
        kwargs = {"revision": cfg.hf_revision}
    try:
        stream = datasets.load_dataset(name, split=cfg.hf_split, streaming=True, **kwargs)
        batches = stream.iter(batch_size=BATCH_DOCUMENTS)
        first = next(batches, None)
    except Exception as err:  # datasets raises many types for a missing or malformed dataset
        raise StagelmError(f"data.source: could not read {where!r}: {first_line(err)}") from None
    if first is None:
        return iter(())
    if cfg.text_field not in first:
        raise StagelmError(f"data.text_field: {where} has no column {cfg.text_field!r}; columns: {sorted(first)}")
    return hf_texts(itertools.chain([first], batches), cfg.text_field, where)


def hf_texts(batches: Iterator[dict[str, list]], field: str, where: str) -> Iterator[list[str]]:
    try:
        for batch in batches:
            texts = batch[field]
            if any(t is not None and not isinstance(t, str) for t in texts):
                raise StagelmError(f"data.text_field: column {field!r} of {where} is not text")
            yield [require_text(t or "", f"{where}, a {field!r} value") for t in texts]
    except StagelmError:
        raise
    except Exception as err:
        raise StagelmError(f"data.source: reading {where!r} failed: {first_line(err)}") from None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` seconds (so offline fails fast)."""
    try:
        socket.create_connection(HUB_HOST, timeout=timeout).close()
        return True
    except OSError:
        return False


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# --- task sets ------------------------------------------------------------------------


def task_sets(cfg: DataConfig, generated: dict[str, list]) -> tuple[dict[str, list], dict[str, str]]:
    """{"sft", "rl", "eval"} rows, and where each came from (files when set, else synthetic)."""
    sets = {
        "sft": generated["sft"],
        "rl": [task_row(t) for t in generated["rl"]],
        "eval": [task_row(t) for t in generated["eval"]],
    }
    origin = {name: f"synthetic(seed={cfg.seed})" for name in sets}
    for name, path in (("sft", cfg.sft_files), ("rl", cfg.rl_files), ("eval", cfg.eval_files)):
        if path:
            sets[name] = read_task_file(path, name)
            origin[name] = f"files:{path}"
    return sets, origin


def task_row(task: Task) -> dict[str, Any]:
    return {
        "family": task.family,
        "prompt": task.prompt,
        "chat_prompt": task.chat_prompt,
        "answer": task.answer,
        "chat_answer": task.chat_answer,
        "spec": json.dumps(task.spec),
    }


def read_task_file(path: str, name: str) -> list[dict[str, Any]]:
    """The rows of the jsonl task files `path` names, each checked against the schema of
    task set `name` (sft: `family`, `messages`; rl and eval: `family`, `prompt`,
    `chat_prompt` and a `spec` the family's checker can read), or one line naming the
    file, line and field. Rows keep only the schema's fields, so Arrow sees one type per column."""
    rows = []
    key = f"data.{name}_files"
    for file in match_files(path, key):
        for i, line in enumerate(open_stream(file), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                raise StagelmError(f"{file}:{i}: not a JSON object; {key} must be jsonl, one task per line")
            require_text(json.dumps(row, ensure_ascii=False), f"{file}:{i}")
            try:
                rows.append(sft_row(row) if name == "sft" else task_file_row(row))
            except ValueError as err:
                raise StagelmError(f"{file}:{i}: {err}; fix the row or {key}") from None
    if not rows:
        raise StagelmError(f"{key}: {path!r} holds no rows")
    return rows


def text_field(row: dict[str, Any], field: str, required: bool = True) -> str:
    if field not in row and not required:
        return ""
    if field not in row:
        raise ValueError(f"{field}: missing")
    value = row[field]
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{field}: expected a non-empty string, got {value!r}"[:200])
    return value


def sft_row(row: dict[str, Any]) -> dict[str, Any]:
    """{family, messages: [{role, content}]}: user and assistant turns, at least one of them trained."""
    family = text_field(row, "family")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: expected a non-empty list of {{role, content}} objects, got {messages!r}"[:200])
    turns = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{j}]: expected a {{role, content}} object, got {message!r}"[:200])
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"messages[{j}].role: expected 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{j}].content: expected a string, got {content!r}"[:200])
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise ValueError("messages: no assistant turn, so nothing to learn from")
    return {"family": family, "messages": turns}


def task_file_row(row: dict[str, Any]) -> dict[str, Any]:
    """An rl or eval task: a registered family, both prompts, and a spec its checker can read."""
    family = text_field(row, "family")
    if family not in FAMILIES:
        raise ValueError(f"family: unknown {family!r}; expected one of {list(FAMILIES)}")
    problem = spec_problem(family, row.get("spec")) if "spec" in row else "spec: missing"
    if problem:
        raise ValueError(problem)
    return {
        "family": family,
        "prompt": text_field(row, "prompt"),
        "chat_prompt": text_field(row, "chat_prompt"),
        "answer": text_field(row, "answer", required=False),
        "chat_answer": text_field(row, "chat_answer", required=False),
        "spec": json.dumps(row["spec"]),
    }


# --- output ---------------------------------------------------------------------------


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


def count_families(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["family"]] = counts.get(row["family"], 0) + 1
    return counts
