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

import os

from stagelm.errors import StagelmError

VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _int_variable(name: str) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        raise StagelmError(f"{name}: expected an integer, got {value!r}") from None
    if number < 0:
        raise StagelmError(f"{name}: expected a non-negative integer, got {value!r}")
    return number


def _slurm_step_of_several_tasks() -> bool:
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def join() -> tuple[int, int]:
    """(this process's index, the process count), after joining the runtime when there are several."""
    if not several_processes():
        return 0, 1
    import jax

    initialize()
    return jax.process_index(), jax.process_count()


def several_processes() -> bool:
    """Whether the environment describes a run of more than one process."""
    if os.environ.get("JAX_NUM_PROCESSES"):
        return _int_variable("JAX_NUM_PROCESSES") > 1
    return _slurm_step_of_several_tasks()


def barrier(name: str) -> None:
    """Wait until every process of the run reaches the barrier `name` (a no-op for one process)."""
    if several_processes():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def initialize() -> None:
    """Join the multi-process runtime when the environment describes one; a no-op otherwise."""
    import jax

    given = [name for name in VARIABLES if os.environ.get(name)]
    if given:
        missing = [name for name in VARIABLES if name not in given]
        if missing:
            raise StagelmError(f"{missing[0]}: not set, but {given[0]} is; set all of {', '.join(VARIABLES)} or none")
        count, index = _int_variable("JAX_NUM_PROCESSES"), _int_variable("JAX_PROCESS_ID")
        if count == 0:
            raise StagelmError("JAX_NUM_PROCESSES: must be at least 1")
        if index >= count:
            raise StagelmError(f"JAX_PROCESS_ID: {index} must be below JAX_NUM_PROCESSES ({count})")
        if count == 1:
            return
        _use_cpu_collectives()
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], count, index)
    elif _slurm_step_of_several_tasks():
        _use_cpu_collectives()
        jax.distributed.initialize()


def _use_cpu_collectives() -> None:
    """CPU devices of different processes exchange data through gloo (other backends ignore this)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
