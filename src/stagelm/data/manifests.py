"""A data folder checked against its manifest.json, as `stagelm check` does before any compute."""

from pathlib import Path

from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json_object, sha256_file


def check_manifest_files(directory: Path, key: str, producer: str) -> dict:
    """The manifest of a data folder, after checking that it exists, that every file it
    lists has its sha256 and that no shard it does not list lies beside them."""
    # Not `dvc checkout --force`: it restores the cache's bytes, and those may be the damaged ones.
    fix = f"rebuild it with `dvc repro -f {producer}`"
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise StagelmError(f"{directory}: no manifest.json, so its files are not a finished {producer}; {fix}")
    manifest = read_json_object(manifest_path, fix)
    entries = manifest.get(key)
    entries = list(entries.values()) if isinstance(entries, dict) else entries
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "file" in e and "sha256" in e for e in entries):
        raise StagelmError(f"{manifest_path}: no `{key}` list of files with sha256; {fix}")
    for entry in entries:
        path = directory / entry["file"]
        if not path.is_file():
            raise StagelmError(f"{path}: listed in {manifest_path} but missing; {fix}")
        if sha256_file(path) != entry["sha256"]:
            raise StagelmError(f"{path}: sha256 differs from {manifest_path}; {fix}")
    listed = {e["file"] for e in entries}
    unlisted = sorted(p.name for p in directory.glob("*.arrow") if p.name not in listed)
    if unlisted:
        raise StagelmError(f"{directory}: shards {unlisted[:3]} are not in its manifest.json (a pack stopped?); {fix}")
    return manifest
