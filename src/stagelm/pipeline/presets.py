"""Presets: params.yaml changes that fit a workload to a device, run as a DVC experiment.

    dvc exp run $(stagelm preset tpu-150m)      # or: stagelm preset tpu-150m  (prints the -S flags)

A preset is a set of `-S section.key=value` overrides of params.yaml, so the run is an
ordinary experiment (`dvc exp show` lists its params beside the others, `dvc exp apply`
makes it the workspace's) and nothing switches by itself on a device: bf16 compute, the
kernel and remat come from the preset a user names. The sizes were measured on one TPU
v5e chip (benchmarks/results/, docs/accelerators.md); every value is checked against
params.yaml's types when the params stage runs, as a hand-written `-S` would be.
"""

from typing import Any, NamedTuple

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import SECTIONS, section_keys

# The accelerator settings every preset shares: bf16 compute on float32 masters, the device's
# attention kernel, one compiled block scanned over the layers.
ACCELERATOR = {
    "model.dtype": "bfloat16",
    "model.param_dtype": "float32",
    "model.attention": "auto",
    "model.scan_layers": True,
    "benchmark.dtype": "bfloat16",
    "benchmark.matmul_size": 8192,
}



class Preset(NamedTuple):
    about: str  # one line: the workload and the device it was measured on
    values: dict[str, Any]  # params.yaml key → value


PRESETS: dict[str, Preset] = {}


def describe(name: str) -> str:
    return PRESETS[name].about


def preset(name: str) -> dict[str, Any]:
    """The overrides of preset `name`, checked to name params.yaml keys."""
    if name not in PRESETS:
        raise StagelmError(f"{name}: no such preset; choose one of {', '.join(sorted(PRESETS))}")
    values = PRESETS[name].values
    for key in values:
        section = key.partition(".")[0]
        if section not in SECTIONS or key not in section_keys(section):
            raise StagelmError(f"preset {name}: {key} is not a params.yaml key")
    return values


def flags(name: str) -> list[str]:
    """`dvc exp run`'s -S flags for preset `name` (YAML spellings: true, null)."""
    return [f"-S {key}={yaml_scalar(value)}" for key, value in preset(name).items()]


def yaml_scalar(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)
