"""One-line user errors and the wrapper every entry point runs under.

A `StagelmError` carries a message that names the key or file at fault and what to
do; `run_main` prints it as one line on stderr and exits non-zero, no traceback. OS
errors (a full disk, a read-only folder, a missing path), undecodable or too-deep input
and a device out of memory are user errors too: the same one line, naming the path.

One process of a multi-process run that fails leaves at once, traceback or line
printed, without waiting for its peers in JAX's shutdown (`srun` then ends them).

Ctrl-C (SIGINT) and SIGTERM end the process at once with exit code 128 + signal:
a KeyboardInterrupt raised inside library code (a checkpoint save, a data loader)
could be caught there and let the stage run on and report success, which DVC would
then record as a finished stage. Files are written atomically and checkpoints are
finalised by rename, so nothing half-written is left for the next run to trust.

Before anything runs, an entry point on Linux may start itself again with huge pages
for malloc (`stagelm.infra.hugepages`): XLA's step buffers then cost far fewer page faults.
And every entry point keeps what XLA compiles on disk (`stagelm.infra.compile_cache`), so a
later stage or command that compiles the same program loads it.
"""

import argparse
import errno
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from stagelm.infra.compile_cache import use_compile_cache
from stagelm.infra.hugepages import restart_with_huge_pages


class StagelmError(Exception):
    """An error caused by the user's params, data or files, reported as one line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands' parsers) with the one-line error every other stagelm error has:
    `error: <prog>: <what argparse found>; see <prog> --help`, exit 2, instead of the usage and the error on
    lines of their own. `--help` prints as before."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with argparse's `message` on one line, naming the command and its --help."""
        self.exit(2, f"error: {self.prog}: {message.replace(chr(10), ' ')}; see `{self.prog} --help`\n")


# What a stage says when a signal stops it; commands (serve, generate) say only what stopped them.
STAGE_INTERRUPTED = "`dvc repro` reruns the stage (a training stage resumes from its last checkpoint)"


def stop_at_once(after: str | None) -> Callable[[int, object], None]:
    """A signal handler that says which signal stopped the process (and `after`, what happens
    next) and exits at once with 128 + the signal's number."""

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        print(f"interrupted by {name}" + (f"; {after}" if after else ""), file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + signum)

    return handler


# What to do about an OS error, by errno: the line names the path, what happened and this.
OS_ADVICE = {
    errno.ENOSPC: "no space left on the device; free some (old runs/.checkpoints, `dvc gc`) and rerun",
    errno.EDQUOT: "disk quota exceeded; free some space or raise the quota, and rerun",
    errno.EROFS: "the file system is read-only; write to a writable folder",
    errno.EACCES: "permission denied; check the owner and mode of the path (or choose another)",
    errno.EPERM: "operation not permitted; check the owner and mode of the path",
    errno.ENOENT: "no such file or directory; check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EISDIR: "is a folder where a file was expected; give a file",
    errno.EEXIST: "already exists; move it away or choose another path",
    errno.EIO: "input/output error; the disk or network file system failed, check it and rerun",
    errno.ENOTEMPTY: "folder not empty; move it away or choose another path",
}


def os_error_line(err: OSError) -> str:
    """One line for an OSError: the path it names, what happened, what to do."""
    where = err.filename if err.filename is not None else "a file"
    advice = OS_ADVICE.get(err.errno, f"{err.strerror or type(err).__name__}; check the path and rerun")
    return f"{where}: {advice}"


def error_line(err: BaseException) -> str | None:
    """The one line an error of the user's data, disk or sizes is reported as; None for a bug."""
    if isinstance(err, StagelmError):
        return str(err)
    if isinstance(err, OSError) and err.errno is not None:
        return os_error_line(err)
    if isinstance(err, UnicodeDecodeError):
        return f"input is not UTF-8 text (byte {err.start}); re-encode it as UTF-8"
    if isinstance(err, RecursionError):
        return "input nested too deeply to read; flatten it"
    if isinstance(err, MemoryError):
        return "out of memory; use smaller sizes (batch_size, seq_len, slots) or a machine with more memory"
    if type(err).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(err):
        figure = next((line.strip() for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line), "")
        return f"the device ran out of memory ({figure[:200]}); use smaller sizes (batch_size, seq_len, slots)"
    if isinstance(err, RuntimeError) and "libtpu" in str(err) and "lockfile" in str(err):
        return TPU_TAKEN
    if isinstance(err, RuntimeError) and str(err).startswith("Symlink loop from "):  # pathlib's resolve() (3.11)
        return f"{str(err).removeprefix('Symlink loop from ').strip(chr(39))}: a symlink loop; give a real path"
    return None


# libtpu lets one process hold a TPU; a second one fails at its first JAX call.
TPU_TAKEN = (
    "the TPU is held by another process (one process at a time can use it): wait for that one, "
    "and run experiments one at a time (dvc exp run --queue, then dvc queue start -j 1)"
)


def one_of_several() -> bool:
    """Whether this process has joined JAX's multi-process runtime (without importing JAX)."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def run_main(main: Callable[[], object], interrupted: str | None = STAGE_INTERRUPTED) -> None:
    """Run an entry point; turn a user error (StagelmError, an OS error, undecodable or
    too-deep input, a device out of memory) into one stderr line and exit code 2. Any
    other exception is a bug and keeps its traceback. SIGINT and SIGTERM end it at once,
    saying `interrupted` (what happens next) after the signal's name."""
    restart_with_huge_pages()
    use_compile_cache()
    handler = stop_at_once(interrupted)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        main()
    except Exception as err:
        line = error_line(err)
        # One process of several leaves at once: exiting normally would wait in JAX's shutdown
        # barrier for peers that may themselves wait on this one, and the launcher (srun) ends
        # the others only when this one has gone.
        at_once = getattr(err, "exit_at_once", False) or one_of_several()
        if line is None:
            if not at_once:
                raise
            traceback.print_exc()
        else:
            print(f"error: {line}", file=sys.stderr)
        if at_once:  # also: library threads left in a state that shutdown would report
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2 if line else 1)
        sys.exit(2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
