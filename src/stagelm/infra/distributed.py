"""Joining JAX's multi-process runtime.

A training stage started as one of several processes calls `initialize()` first. It
joins `jax.distributed` when the launcher set it up, in either of two ways:

- the three standard variables, the same on every host but the id:
  `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and
  `JAX_PROCESS_ID`;
- or a SLURM job step of more than one task (`srun`), which JAX detects by itself.

Otherwise it is a single-process run and nothing happens. On CPU the processes talk
through gloo, JAX's CPU collectives.

The processes are started by `stagelm launch` (see stagelm.cli), which puts params.yaml's
`launch.command` (e.g. `srun --nodes=2 --ntasks-per-node=4`) before a training
stage's command, or the pack stage's: a data stage calls `join()`, which imports JAX
only when there are several processes, and meets the others with `barrier(name)`.
"""

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Iterator

from stagelm.infra.errors import StagelmError

VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# What JAX reads of a SLURM job step to find its peers (jax._src.clusters.slurm_cluster).
SLURM_INTS = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_NODES")
# host:port, the host a name, an IPv4 address or a bracketed IPv6 one.
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d+)$")


def _int_variable(name: str, minimum: int = 0) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        raise StagelmError(f"{name}: expected an integer, got {value!r}; fix or unset it") from None
    if number < minimum:
        raise StagelmError(f"{name}: expected an integer >= {minimum}, got {value!r}; fix or unset it")
    return number


def process_count() -> int:
    """The number of processes the environment describes (1: none), after checking every
    variable JAX would read, so a mistyped one fails in one line naming it before any work:
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (all three or none),
    or a SLURM job step's `SLURM_*` counts and ids."""
    given = [name for name in VARIABLES if os.environ.get(name)]
    if given:
        missing = [name for name in VARIABLES if name not in given]
        if missing:
            raise StagelmError(f"{missing[0]}: not set, but {given[0]} is; set all of {', '.join(VARIABLES)} or none")
        address = os.environ["JAX_COORDINATOR_ADDRESS"]
        found = _ADDRESS.match(address)
        if found is None or not 0 < int(found.group(2)) < 65536:
            raise StagelmError(
                f"JAX_COORDINATOR_ADDRESS: {address!r} is not host:port (a port in 1-65535, an IPv6 host in "
                "brackets); give process 0's address and a free port"
            )
        count, index = _int_variable("JAX_NUM_PROCESSES", 1), _int_variable("JAX_PROCESS_ID")
        if index >= count:
            raise StagelmError(f"JAX_PROCESS_ID: {index} must be below JAX_NUM_PROCESSES ({count})")
        return count
    if "SLURM_STEP_ID" in os.environ:
        counts = {name: _int_variable(name) for name in SLURM_INTS if name in os.environ}
        return max(counts.get("SLURM_STEP_NUM_TASKS", 1), 1)
    return 1


def join(timeout: int = 300) -> tuple[int, int]:
    """(this process's index, the process count), after joining the runtime when there are
    several (`initialize`); the environment is checked first whatever it describes."""
    if process_count() == 1:
        return 0, 1
    import jax

    initialize(timeout)
    return jax.process_index(), jax.process_count()


def several_processes() -> bool:
    """Whether the environment describes a run of more than one process."""
    return process_count() > 1


def barrier(name: str) -> None:
    """Wait until every process of the run reaches the barrier `name` (a no-op for one process)."""
    if several_processes():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def initialize(timeout: int = 300) -> None:
    """Join the multi-process runtime when the environment describes one (`process_count`); a
    no-op otherwise. The join gives up after `timeout` seconds (`launch.initialization_timeout`)
    with one line naming the coordinator it could not reach, and a SIGTERM while it waits ends
    the process at once (the Python handler cannot run while JAX's C++ join holds the thread)."""
    if process_count() == 1:
        return
    import jax

    _use_cpu_collectives()
    deadline = time.monotonic() + timeout
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        address, index = os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_PROCESS_ID"])
        wait_for_coordinator(address, index, deadline, timeout)
        args = (address, int(os.environ["JAX_NUM_PROCESSES"]), index)
        where = f"JAX_COORDINATOR_ADDRESS: the coordinator at {address}"
    else:
        args, where = (), "SLURM_STEP_NODELIST: the coordinator on the step's first node"
    left = max(1, round(deadline - time.monotonic()))
    try:
        with default_sigterm():
            jax.distributed.initialize(*args, initialization_timeout=left)
    except Exception as err:  # JAX's runtime raises its own kinds; what the user acts on is the address
        if "DEADLINE_EXCEEDED" not in str(err) and "UNAVAILABLE" not in str(err):
            raise
        raise StagelmError(
            f"{where} did not answer within {timeout} s (launch.initialization_timeout); {ADVICE}"
        ) from None


ADVICE = "check that process 0 runs there and that the port is open between the hosts"


def wait_for_coordinator(address: str, index: int, deadline: float, timeout: int) -> None:
    """Before JAX's own join, which on a coordinator it cannot reach ends the process with a
    C++ check failure instead of an error: the host must resolve, and a process other than 0
    waits (in Python, where SIGTERM is handled) until the coordinator's port accepts a connection."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, UnicodeError) as err:
        raise StagelmError(
            f"JAX_COORDINATOR_ADDRESS: the host {host!r} does not resolve ({err}); "
            "give process 0's host name or address"
        ) from None
    if index == 0:  # process 0 starts the coordinator itself
        return
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise StagelmError(
                    f"JAX_COORDINATOR_ADDRESS: the coordinator at {address} did not answer within {timeout} s "
                    f"(launch.initialization_timeout); {ADVICE}"
                ) from None
            time.sleep(0.5)


@contextlib.contextmanager
def default_sigterm() -> Iterator[None]:
    """SIGTERM's default action (end the process) for the duration."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _use_cpu_collectives() -> None:
    """CPU devices of different processes exchange data through gloo (other backends ignore this)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
