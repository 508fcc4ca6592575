"""The download stage's library: a corpus and task sets, split and written as Parquet.

`data.source` picks where the corpus comes from:

- `synthetic`: generated from `data.seed` (see `stagelm.data.synthetic`);
- `files:<path, dir or glob>`: txt, jsonl / json, csv or parquet files, plain or
  compressed (`stagelm.data.corpus_files`);
- `hf:<dataset id>` through `datasets` (streamed, pinned by `data.hf_revision`), or
  `hf:<local dataset dir>` for a dataset on disk (`stagelm.data.hub`).

Documents stream through in batches: a file source of any size costs one batch and
one Parquet row group of memory. Blank documents are dropped and `data.max_documents`
caps the rest. The validation split of a file or hub corpus is chosen per document by
a hash of `data.seed` and its text, so it does not depend on the reading order and
adding files never moves an old document between splits (the same text always lands
in the same split). The synthetic corpus keeps its seeded choice of documents.

Task sets come from `data.sft_files`, `data.rl_files` and `data.eval_files` when set,
and from the synthetic task families otherwise (`stagelm.data.task_sets`; the manifest
says which).
"""

import hashlib
import math
import random
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from stagelm.data import synthetic
from stagelm.data.corpus_files import match_files, read_file
from stagelm.data.hub import hf_batches
from stagelm.data.parquet_writer import TextWriter, write_table
from stagelm.data.task_sets import count_families, task_sets
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import write_json
from stagelm.infra.memory import gib, host_available, require_memory
from stagelm.pipeline.config import DataConfig
from stagelm.tasks import select

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
    """Stream the corpus of `data.source` into `out_dir` (Parquet per split and task set, manifest.json
    last); return the manifest and the input files read (none for synthetic/hf). Everything is written to
    temporary files first: a bad input leaves the folder as it was, and a run killed while renaming
    leaves no manifest, so nothing looks done."""
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
        for name in sets:  # sft, rl, eval; pref when data.pref_files is set
            files[name] = write_table(out_dir / f"{name}.parquet", pa.Table.from_pylist(sets[name]))
        (out_dir / "manifest.json").unlink(missing_ok=True)  # from here until the new one: not done
        for name, entry in files.items():
            (out_dir / f"{name}.parquet.tmp").replace(out_dir / entry["file"])
        if "pref" not in sets:  # an earlier run's pairs, no longer named by data.pref_files
            (out_dir / "pref.parquet").unlink(missing_ok=True)
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
        **({"pairs": len(sets["pref"])} if "pref" in sets else {}),
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
