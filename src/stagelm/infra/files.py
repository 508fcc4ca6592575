"""Small file helpers shared by every stage: atomic writes, sha256, JSON."""

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stagelm.infra.errors import StagelmError


@functools.cache
def file_mode() -> int:
    """The mode `open()` gives a new file, 0o666 less the umask: what an atomic write gives its
    file too (a temporary file starts at 0o600, which another user or service cannot read)."""
    try:
        with open("/proc/self/status") as f:  # read without changing it (os.umask both sets and gets)
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Give `path` to the OS errors raised inside that name no file: a failed write (a full
    disk) reports only its errno, and the one line the user reads must say where."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from None
        if err.errno is None and "requested and" in str(err):  # numpy's short write: "4096 requested and 3584 written"
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({err})", str(path)) from None
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming(path), os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_file(source: str | Path, dest: str | Path) -> None:
    """Copy `source` to `dest` atomically, with `dest`'s mode as a new file's; an error while
    writing names `dest` (shutil names the source even when the destination's disk is full)."""
    atomic_write_bytes(dest, Path(source).read_bytes())


def replace_folder(new: Path, old: Path) -> None:
    """Put the finished folder `new` where `old` is, by renames (same file system): `old`
    steps aside as `.<name>.old` and is removed only once `new` is in its place."""
    aside = old.with_name(f".{old.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    if old.exists():
        old.rename(aside)
    new.rename(old)
    shutil.rmtree(aside, ignore_errors=True)


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically write `obj` as indented, key-sorted JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def read_json_object(path: str | Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`, or one line naming the file, what is wrong and `fix`."""
    try:
        obj = read_json(path)
    except FileNotFoundError:
        raise StagelmError(f"{path}: missing; {fix}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise StagelmError(f"{path}: not valid JSON ({str(err)[:80]}); {fix}") from None
    if not isinstance(obj, dict):
        raise StagelmError(f"{path}: expected a JSON object, got {type(obj).__name__}; {fix}")
    return obj


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: str | Path) -> str:
    """One sha256 over a file or over every file of a directory (relative names and contents)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode() + b"\0" + sha256_file(file).encode())
    return h.hexdigest()
