"""Presets: params.yaml changes that fit a workload to a device, run as a DVC experiment.

    dvc exp run $(stagelm preset tpu-150m)      # or: stagelm preset tpu-150m  (prints the -S flags)

A preset is a set of `-S section.key=value` overrides of params.yaml, so the run is an
ordinary experiment (`dvc exp show` lists its params beside the others, `dvc exp apply`
makes it the workspace's) and nothing switches by itself on a device: bf16 compute, the
kernel and remat come from the preset a user names. The sizes were measured on one TPU
v5e chip (benchmarks/results/, docs/accelerators.md); every value is checked against
params.yaml's types when the params stage runs, as a hand-written `-S` would be.
"""

import json
from pathlib import Path
from typing import Any, NamedTuple

from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import SECTIONS, section_keys

# The accelerator settings every preset shares: bf16 compute on float32 masters, the device's
# attention kernel (splash on a TPU), every activation kept (these sizes fit without remat;
# keeping only the projections' outputs ran 10% slower at d1024), the blocks unrolled (scanned
# they compiled 40% faster but ran 25% slower). Measured on a v5e: docs/accelerators.md.
ACCELERATOR = {
    "model.dtype": "bfloat16",
    "model.param_dtype": "float32",
    "model.attention": "auto",
    "model.remat": "none",
    "model.scan_layers": False,
    "benchmark.dtype": "bfloat16",
    "benchmark.matmul_size": 8192,
}
# 64 rows of 2048 tokens per step in micro-batches of 2: on a v5e smaller micro-batches ran
# faster at the same global batch (4 → 2 rows: +0.6%; 8 → 4: +9%).
SMALL_MICRO_BATCHES = {"training.batch_size": 2, "training.grad_accum": 32, "pack.seq_len": 2048}


# The committed measurements (benchmarks/accelerator-*.json) in a source checkout; an installed
# package has none, and its descriptions then say where the figures are.
MEASUREMENTS = Path(__file__).resolve().parents[3] / "benchmarks"


class Preset(NamedTuple):
    about: str  # one line: the workload and the device it was measured on
    values: dict[str, Any]  # params.yaml key → value
    measured: tuple[str, str]  # (the benchmarks/ file, its unscanned train entry's shape) describe() quotes


PRESETS: dict[str, Preset] = {
    "tpu-150m": Preset(
        "pretrain a 155M decoder (d1024, 8 layers, 4 heads of 256, vocab 32768, seq 2048) on one 16 GiB TPU v5e chip",
        {
            **ACCELERATOR,
            **SMALL_MICRO_BATCHES,
            "tokenizer.vocab_size": 32768,
            "model.d_model": 1024,
            "model.n_layers": 8,
            "model.n_heads": 4,
            "model.n_kv_heads": 4,
            "model.d_ff": 3584,
            # The default distill.student (d_model 128) cannot be pruned from this width, and a preset's
            # -S flags are scalars: the student learns from random weights (distill.init: scratch).
            "distill.init": "scratch",
        },
        ("accelerator-2026-12-06-i.json", "d1024-l8-h4"),
    ),
    "tpu-smollm2-135m": Preset(
        "continue pretraining and fine-tune SmolLM2-135M (set model.init_from to its checkpoint) on one "
        "16 GiB TPU v5e chip at seq 2048, 64 rows a step (its shape at random weights)",
        {**ACCELERATOR, **SMALL_MICRO_BATCHES, "sft.batch_size": 2, "sft.grad_accum": 32},
        ("accelerator-2026-12-06-h.json", "smollm2-135m"),
    ),
}


def describe(name: str) -> str:
    """The preset's line: its workload, and the throughput and MFU (MaxText's count) of its
    committed measurement, read from that file."""
    about, _, (file, shape) = PRESETS[name]
    path = MEASUREMENTS / file
    if not path.is_file():
        return f"{about} (measured: benchmarks/{file} of stagelm's repository)"
    result = json.loads(path.read_text())
    entry = next(e for e in result["train"] if e["name"] == shape and not e["scan_layers"] and "error" not in e)
    figures = f"{entry['tokens_per_sec'] / 1e3:.1f}k tok/s, MFU {entry['mfu']:.1%}"
    return f"{about}: {figures} ({result['device_kind']}, benchmarks/{file})"


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
