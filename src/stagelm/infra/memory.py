"""Memory a stage or the server is about to ask for, against what the machine has.

A size typed into params.yaml or a flag should fail in one line before anything is
allocated, not as an out-of-memory traceback minutes later or a machine swapping. The
figures asked for come from arithmetic on the shapes (`stagelm.model.footprint` for a
decoder, `stagelm.data.pack` for pack's buffers); what is available is the accelerator's
own limit, or on the CPU the smaller of the kernel's MemAvailable and what the process's
cgroup still allows.

    require_memory(need, "--slots", f"{slots} slots × {capacity} positions of KV cache")
"""

from decimal import Decimal
from pathlib import Path

from stagelm.infra.errors import StagelmError

GIB = 1 << 30
# More memory than any one machine holds (the largest hosts hold tens of TiB, an accelerator well under
# one): what one process or one device must hold beyond it runs nowhere, where a figure beyond this
# machine's memory may still fit the one a stage runs on (`stagelm check` warns of that one).
ONE_MACHINE = 1 << 46
# What the rest of the process needs beside the figure checked (the runtime, compiled
# programs, buffers the arithmetic does not count): a request must leave this much free.
HEADROOM = 1 << 29


def cgroup_limit() -> int | None:
    """Bytes the process's cgroup still allows (v2's memory.max, or v1's memory controller),
    or None when it sets no limit or cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files = Path("/sys/fs/cgroup", path.lstrip("/")), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            files = Path("/sys/fs/cgroup/memory", path.lstrip("/")), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder, limit_file, usage_file = files
        try:
            limit = (folder / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # no limit set
                continue
            return int(limit) - int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
    return None


def host_available() -> int | None:
    """min(MemAvailable, the cgroup's room) in bytes; None where neither can be read."""
    figures = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                figures.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    room = cgroup_limit()
    if room is not None:
        figures.append(room)
    return min(figures) if figures else None


def available_bytes() -> int | None:
    """Memory the first local device can still hand out (an accelerator's own figures), or the host's."""
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_available()


def gib(n: int) -> str:
    if n >= GIB << 60:  # beyond what a float divides (params.yaml's ints have no bound): its order of size
        return f"{Decimal(n // GIB):.1e} GiB"
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):,.1f} MiB"


def require_one_machine(need: int, key: str, what: str) -> None:
    """Refuse, naming `key`, `need` bytes (for `what`, held by one process or device whatever the mesh)
    that no machine holds (ONE_MACHINE), wherever the stage would run."""
    if need > ONE_MACHINE:
        raise StagelmError(
            f"{key}: {what} needs about {gib(need)}, more than any one machine holds ({gib(ONE_MACHINE)}); lower it"
        )


def require_memory(need: int, key: str, what: str, have: int | None = None, fix: str = "lower it") -> None:
    """Refuse, naming `key`, when `need` bytes (for `what`) do not fit in what is available."""
    have = available_bytes() if have is None else have
    if have is not None and need + HEADROOM > have:
        raise StagelmError(f"{key}: {what} needs {gib(need)}, but {gib(have)} is available; {fix}")
