"""The download stage's library: read a corpus and task sets, split, write Parquet.

`data.source` picks where the corpus comes from:

- `synthetic`: generated from `data.seed` (see `stagelm.synthetic`);
- `files:<path, dir or glob>`: txt (one document per blank-line-separated paragraph),
  jsonl/json, parquet or csv through `datasets`, text in column `data.text_field`;
- `hf:<dataset id>` through `datasets` (streamed, pinned by `data.hf_revision`, capped
  by `data.max_documents`), or `hf:<local dataset dir>` for a dataset on disk.

Task sets come from `data.sft_files`, `data.rl_files` and `data.eval_files` when set,
and from the synthetic task families otherwise (the manifest says which).
"""

import glob
import json
import math
import random
import socket
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm import synthetic
from stagelm.config import DataConfig
from stagelm.errors import StagelmError
from stagelm.files import sha256_file, write_json
from stagelm.tasks import FAMILIES, Task

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HUB_HOST = ("huggingface.co", 443)


def collect(cfg: DataConfig) -> tuple[list[str], list[str], dict[str, list], dict[str, Any]]:
    """Everything the download stage writes: (train docs, val docs, task sets, manifest facts)."""
    is_synthetic = cfg.source == "synthetic"
    generated = synthetic.generate(
        cfg.seed, cfg.num_documents if is_synthetic else 0, cfg.num_sft, cfg.num_rl, cfg.num_eval
    )
    docs, desc = read_source(cfg, generated["corpus"])
    train, val = split_documents(docs, cfg.val_fraction, cfg.seed)
    sets, origin = task_sets(cfg, generated)
    meta = {
        "source": desc,
        "data_seed": cfg.seed,
        "task_sets": origin,
        "documents": {"train": len(train), "val": len(val)},
    }
    return train, val, sets, meta


def read_source(cfg: DataConfig, synthetic_corpus: list[str]) -> tuple[list[str], str]:
    """(documents, a description of where they came from) for `data.source`."""
    scheme, _, arg = cfg.source.partition(":")
    if cfg.source == "synthetic":
        docs = synthetic_corpus
        desc = f"synthetic(seed={cfg.seed}, num_documents={cfg.num_documents})"
    elif scheme == "files" and arg:
        docs, desc = read_files(arg, cfg.text_field), f"files:{arg}"
    elif scheme == "hf" and arg:
        docs, desc = read_hf(arg, cfg), f"hf:{arg}@{cfg.hf_revision}/{cfg.hf_split}"
    else:
        raise StagelmError(
            f"data.source: unknown source {cfg.source!r}; use 'synthetic', 'files:<path or glob>' or 'hf:<dataset id>'"
        )
    if cfg.max_documents is not None:
        docs = docs[: cfg.max_documents]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise StagelmError(f"data.source: {cfg.source!r} holds no non-empty documents; point it at a corpus with text")
    return docs, desc


def match_files(pattern: str) -> list[Path]:
    path = Path(pattern)
    found = sorted(path.rglob("*")) if path.is_dir() else sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    found = [p for p in found if p.is_file() and p.suffix in BUILDERS]
    if not found:
        raise StagelmError(
            f"data.source: 'files:{pattern}' matches no {'/'.join(BUILDERS)} file; check the path or glob"
        )
    kinds = {BUILDERS[p.suffix] for p in found}
    if len(kinds) > 1:
        raise StagelmError(f"data.source: 'files:{pattern}' mixes file kinds {sorted(kinds)}; use one kind")
    blank = True
    for p in found:
        if p.suffix != ".parquet":
            try:
                blank = blank and not p.read_bytes().decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise StagelmError(f"{p}: not UTF-8 text (byte {err.start}); re-encode it as UTF-8") from None
        else:
            blank = False
    if blank:
        raise StagelmError(
            f"data.source: 'files:{pattern}' holds no non-empty documents; point it at a corpus with text"
        )
    return found


def read_files(pattern: str, text_field: str) -> list[str]:
    import datasets

    files = match_files(pattern)
    builder = BUILDERS[files[0].suffix]
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", **kwargs)
    except Exception as err:  # datasets raises many types for a malformed file
        raise StagelmError(f"data.source: could not read {pattern!r} as {builder}: {first_line(err)}") from None
    if builder == "text":  # a paragraph keeps the file's final newline; drop it
        return [t.rstrip("\n") for t in column_texts(ds, "text", f"files:{pattern}")]
    return column_texts(ds, text_field, f"files:{pattern}")


def read_hf(name: str, cfg: DataConfig) -> list[str]:
    import datasets

    if Path(name).is_dir():  # a dataset on disk: no hub, no pin needed
        try:
            ds = datasets.load_dataset(name, split=cfg.hf_split)
        except Exception as err:
            raise StagelmError(f"data.source: could not load local dataset {name!r}: {first_line(err)}") from None
        return column_texts(ds, cfg.text_field, f"hf:{name}")
    if not cfg.hf_revision:
        raise StagelmError(f"data.hf_revision: pin hub dataset {name!r} to a commit, tag or branch")
    if not hub_reachable():
        raise StagelmError(
            f"data.source: the Hugging Face hub is unreachable, so 'hf:{name}' cannot be read; "
            "download it elsewhere and use 'hf:<local dir>' or 'files:<glob>'"
        )
    try:
        stream = datasets.load_dataset(name, revision=cfg.hf_revision, split=cfg.hf_split, streaming=True)
        rows = stream.take(cfg.max_documents) if cfg.max_documents else stream
        rows = list(rows)
    except Exception as err:
        raise StagelmError(f"data.source: could not stream 'hf:{name}': {first_line(err)}") from None
    if rows and cfg.text_field not in rows[0]:
        raise StagelmError(f"data.text_field: 'hf:{name}' has no column {cfg.text_field!r}; columns: {list(rows[0])}")
    return [r[cfg.text_field] for r in rows]


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` seconds (so offline fails fast)."""
    try:
        socket.create_connection(HUB_HOST, timeout=timeout).close()
        return True
    except OSError:
        return False


def column_texts(ds: Any, field: str, where: str) -> list[str]:
    if field not in ds.column_names:
        raise StagelmError(f"data.text_field: {where} has no column {field!r}; columns: {ds.column_names}")
    texts = ds[field]
    if any(t is not None and not isinstance(t, str) for t in texts):
        raise StagelmError(f"data.text_field: column {field!r} of {where} is not text")
    return [t for t in texts if t]


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, val) by document: a seeded choice of ceil(fraction·n) documents for val, order kept."""
    if len(docs) < 2:
        raise StagelmError(f"data.source: {len(docs)} document(s) cannot be split into train and val; add documents")
    n_val = min(len(docs) - 1, max(1, math.ceil(val_fraction * len(docs))))
    val_idx = set(random.Random(seed).sample(range(len(docs)), n_val))
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


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


TASK_FIELDS = {
    "sft": ("family", "messages"),
    "rl": ("family", "prompt", "chat_prompt", "spec"),
    "eval": ("family", "prompt", "chat_prompt", "spec"),
}


def read_task_file(path: str, name: str) -> list[dict[str, Any]]:
    rows = []
    key = f"data.{name}_files"
    for file in match_files(path):
        for i, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise StagelmError(f"{file}:{i}: not a JSON object; {key} must be jsonl") from None
            missing = [f for f in TASK_FIELDS[name] if f not in row]
            if missing:
                raise StagelmError(f"{file}:{i}: missing {missing} for {key}")
            if name != "sft" and row["family"] not in FAMILIES:
                raise StagelmError(f"{file}:{i}: unknown family {row['family']!r}; expected one of {list(FAMILIES)}")
            if name != "sft":
                row = {"answer": "", "chat_answer": "", **row, "spec": json.dumps(row["spec"])}
            rows.append(row)
    if not rows:
        raise StagelmError(f"{key}: {path!r} holds no rows")
    return rows


# --- output ---------------------------------------------------------------------------


def write_raw(out_dir: Path, train: list[str], val: list[str], sets: dict[str, list], meta: dict) -> dict:
    """Write the Parquet files and manifest.json into `out_dir`; return the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {
        "corpus_train": pa.table({"text": train}),
        "corpus_val": pa.table({"text": val}),
        "sft": pa.Table.from_pylist(sets["sft"]),
        "rl": pa.Table.from_pylist(sets["rl"]),
        "eval": pa.Table.from_pylist(sets["eval"]),
    }
    files = {}
    for name, table in tables.items():
        path = out_dir / f"{name}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        tmp.replace(path)
        files[name] = {"file": path.name, "rows": table.num_rows, "sha256": sha256_file(path)}
    families = {name: count_families(sets[name]) for name in ("sft", "rl", "eval")}
    manifest = {
        "schema_version": 1,
        **meta,
        "files": files,
        "families": families,
        "corpus_characters": {"train": sum(map(len, train)), "val": sum(map(len, val))},
    }
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def count_families(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["family"]] = counts.get(row["family"], 0) + 1
    return counts
