"""One-line user errors and the wrapper every entry point runs under.

A `StagelmError` carries a message that names the key or file at fault and what to
do; `run_main` prints it as one line on stderr and exits non-zero, no traceback.

Ctrl-C (SIGINT) and SIGTERM end the process at once with exit code 128 + signal:
a KeyboardInterrupt raised inside library code (a checkpoint save, a data loader)
could be caught there and let the stage run on and report success, which DVC would
then record as a finished stage. Files are written atomically and checkpoints are
finalised by rename, so nothing half-written is left for the next run to trust.

Before anything runs, an entry point on Linux may start itself again with huge pages
for malloc (`stagelm.hugepages`): XLA's step buffers then cost far fewer page faults.
"""

import os
import signal
import sys
from collections.abc import Callable

from stagelm.hugepages import restart_with_huge_pages


class StagelmError(Exception):
    """An error caused by the user's params, data or files, reported as one line."""


def stop_at_once(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    print(f"interrupted by {name}: the next `dvc repro` resumes from the last checkpoint", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signum)


def run_main(main: Callable[[], object]) -> None:
    """Run an entry point; turn a StagelmError into one stderr line and exit code 2."""
    restart_with_huge_pages()
    previous = {sig: signal.signal(sig, stop_at_once) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        main()
    except StagelmError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
