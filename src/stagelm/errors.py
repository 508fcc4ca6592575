"""One-line user errors and the wrapper every entry point runs under.

A `StagelmError` carries a message that names the key or file at fault and what to
do; `run_main` prints it as one line on stderr and exits non-zero, no traceback.
"""

import sys
from collections.abc import Callable


class StagelmError(Exception):
    """An error caused by the user's params, data or files, reported as one line."""


def run_main(main: Callable[[], object]) -> None:
    """Run an entry point; turn a StagelmError into one stderr line and exit code 2."""
    try:
        main()
    except StagelmError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
