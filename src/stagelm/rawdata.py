"""Read the download stage's output (`data/raw/`), checked against its manifest."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm.errors import StagelmError
from stagelm.files import read_json, sha256_file


def read_raw(raw_dir: str | Path, name: str) -> pa.Table:
    """Table `name` (corpus_train, corpus_val, sft, rl, eval) of the raw data, sha256-checked."""
    raw_dir = Path(raw_dir)
    manifest_path = raw_dir / "manifest.json"
    if not manifest_path.is_file():
        raise StagelmError(f"{manifest_path}: missing; run `dvc repro download` (or `dvc pull download`)")
    entry = read_json(manifest_path)["files"].get(name)
    if entry is None:
        raise StagelmError(f"{manifest_path}: lists no {name!r} file; rerun `dvc repro download`")
    path = raw_dir / entry["file"]
    if not path.is_file():
        raise StagelmError(f"{path}: missing; run `dvc checkout` or `dvc repro download`")
    if sha256_file(path) != entry["sha256"]:
        raise StagelmError(f"{path}: sha256 differs from {manifest_path} (corrupt or edited); run `dvc checkout`")
    return pq.read_table(path)
