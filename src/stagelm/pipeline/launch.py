"""`stagelm launch`: a stage's command behind params.yaml's `launch.command` (e.g. srun), or as it is."""

import os
import shlex

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.params import load_section, read_params


def launch(command: list[str]) -> None:
    """Replace this process by `command` behind `launch.command` of the params file the command
    names (`--params`, default params.yaml)."""
    if not command:
        raise StagelmError("launch: give the stage command, e.g. `stagelm launch python stages/pretrain.py ...`")
    params_file = command[command.index("--params") + 1] if "--params" in command[:-1] else "params.yaml"
    argv = shlex.split(load_section(read_params(params_file), "launch").command) + command
    # srun's default, when one task of a step fails, is to wait for the others: peers stuck in a
    # collective wait forever. Ask it to end the step at once (a --kill-on-bad-exit in the command wins).
    os.environ.setdefault("SLURM_KILL_BAD_EXIT", "1")
    try:
        os.execvp(argv[0], argv)  # the stage (or the wrapper) replaces this process: signals reach it directly
    except OSError as err:
        raise StagelmError(f"launch.command: cannot run {argv[0]!r} ({err.strerror}); fix launch.command") from None
