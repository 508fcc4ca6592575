"""Small file helpers shared by every stage: atomic writes, sha256, JSON."""

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stagelm.infra.errors import StagelmError


@functools.cache
def umask() -> int:
    """This process's umask, read without changing it (os.umask both sets and gets)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def file_mode() -> int:
    """The mode `open()` gives a new file, 0o666 less the umask: what an atomic write gives its
    file too (a temporary file starts at 0o600, which another user or service cannot read)."""
    return 0o666 & ~umask()


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


def folder_beside(path: Path, what: str) -> Path:
    """A new, empty folder beside `path` (the same file system, so it can be renamed into place),
    under a name no one else's folder has (`.<name>.<what>-<random>`), with a new folder's mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{what}-"))
    os.chmod(folder, 0o777 & ~umask())  # mkdtemp's is 0o700
    return folder


def replace_folder(new: Path, old: Path) -> None:
    """Put the finished folder `new` where `old` is, by renames (same file system): `old`
    steps aside as `.<name>.old-<random>` and is removed only once `new` is in its place."""
    if not old.exists():
        new.rename(old)
        return
    aside = Path(tempfile.mkdtemp(dir=old.parent, prefix=f".{old.name}.old-"))  # a name no one else's folder has
    old.rename(aside)  # onto the empty folder just made
    new.rename(old)
    shutil.rmtree(aside, ignore_errors=True)


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically write `obj` as indented, key-sorted JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


# The most a metadata file (a config.json, a tokenizer_config.json, a manifest) may hold: far above
# any real one, and low enough that a file of garbage cannot take the machine's memory.
MAX_JSON_BYTES = 64 << 20


def regular_file_size(path: str | Path, limit: int | None, fix: str) -> int:
    """The size of `path`, a regular file (followed through links) of at most `limit` bytes, or one line
    naming it and `fix`: a device (a link to /dev/zero reads forever), a pipe (blocks forever), a
    folder or a file past the limit is refused before it is opened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        why = "a link to nothing" if os.path.islink(path) else "missing"
        raise StagelmError(f"{path}: {why}; {fix}") from None
    return checked_size(path, info, limit, fix)


def checked_size(path: str | Path, info: os.stat_result, limit: int | None, fix: str) -> int:
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a device, pipe or socket"
        raise StagelmError(f"{path}: {kind}, not a regular file; {fix}")
    if limit is not None and info.st_size > limit:
        raise StagelmError(f"{path}: {info.st_size:,} bytes, more than the {limit:,} such a file may hold; {fix}")
    return info.st_size


def read_regular_file(path: str | Path, limit: int, fix: str) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (`regular_file_size`), checked again
    on the open descriptor (never blocking on a pipe put there since) and read no further than the limit."""
    regular_file_size(path, limit, fix)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        checked_size(path, os.fstat(fd), limit, fix)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise StagelmError(f"{path}: more than the {limit:,} bytes such a file may hold; {fix}")
    return data


def read_json_object(path: str | Path, fix: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in `path` (a regular file of at most `limit` bytes), or one line naming the
    file, what is wrong and `fix`."""
    try:
        obj = json.loads(read_regular_file(path, limit, fix))
    except FileNotFoundError:
        raise StagelmError(f"{path}: missing; {fix}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise StagelmError(f"{path}: not valid JSON ({str(err)[:80]}); {fix}") from None
    except RecursionError:
        raise StagelmError(f"{path}: JSON nested too deeply to read; {fix}") from None
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
