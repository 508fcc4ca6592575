"""Huge pages for XLA's buffers on Linux: glibc's `glibc.malloc.hugetlb=1`, set before start-up.

XLA:CPU allocates a step's buffers with malloc, and glibc maps every large block afresh
from the kernel and unmaps it when freed, so each step touches its activations as new
memory: one page fault per 4 KiB page. The tiny benchmark step took about 166,000 faults
and 0.5 s of kernel time a step on a 2-core AVX2 machine (benchmarks/README.md). With
`glibc.malloc.hugetlb=1` in GLIBC_TUNABLES (glibc 2.35 and later) malloc advises the
kernel to back its mappings with 2 MiB pages where the kernel's transparent-huge-page
mode is `madvise`: the same step took under a thousand faults and ran up to a third
faster (−4 to +9% on a busier state of that machine). The bytes computed are the same;
only how memory is mapped changes.

glibc reads GLIBC_TUNABLES once, as the process starts, so `restart_with_huge_pages`
starts the entry point again (os.execve: the same pid, arguments and open files) with
the variable set. `make` exports it, so stages started by `make repro` and the tests
never restart; a caller's own `glibc.malloc.hugetlb` setting (0 turns it off) is kept.
"""

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError):
        return None
    if not name or not name.startswith("glibc "):
        return None
    major, minor = name.split()[1].split(".")[:2]
    return int(major), int(minor)


def huge_pages_help(environ: dict[str, str], libc: tuple[int, int] | None, thp_mode: str) -> bool:
    """Whether setting the tunable would change anything: glibc ≥ 2.35, the kernel's THP
    mode `madvise` (`always` backs malloc's mappings already, `never` refuses), and the
    caller has not chosen either way."""
    if TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return False
    return libc is not None and libc >= (2, 35) and "[madvise]" in thp_mode


def restart_with_huge_pages() -> None:
    """Start this process again with `glibc.malloc.hugetlb=1` where that helps; else return."""
    if sys.platform != "linux":
        return
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return
    if not huge_pages_help(dict(os.environ), glibc_version(), mode):
        return
    tunables = os.environ.get("GLIBC_TUNABLES")
    setting = f"{TUNABLE}=1"
    env = dict(os.environ, GLIBC_TUNABLES=f"{tunables}:{setting}" if tunables else setting)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
