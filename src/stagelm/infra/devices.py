"""What the devices can do: published peak FLOP/s per accelerator, for MFU.

Peaks are dense (no sparsity) figures from the vendors' data sheets. CPUs have no
entry: their MFU is measured against a large jitted matmul instead (benchmark stage).
"""

from typing import Any

import jax

PEAK_FLOPS = {  # device_kind substring → {dtype: FLOP/s}
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5e": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v5": {"bfloat16": 459e12, "float32": 459e12},
}


HBM_BANDWIDTH = {  # device_kind substring → bytes/s of the accelerator's memory (data sheets)
    "H200": 4.8e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 819e9,
    "TPU v5e": 819e9,
    "TPU v5p": 2.76e12,
}


def device_figure(table: dict[str, Any], devices: list | None = None) -> Any:
    """The entry of `table` whose key is in the first device's kind, or None (e.g. a CPU)."""
    kind = (jax.devices() if devices is None else devices)[0].device_kind.lower()
    return next((value for name, value in table.items() if name.lower() in kind), None)


def hbm_bandwidth(devices: list | None = None) -> float | None:
    """One device's memory bandwidth in bytes/s, or None when unknown: decoding's bound."""
    return device_figure(HBM_BANDWIDTH, devices)


def peak_flops(dtype: str, devices: list | None = None) -> float | None:
    """Summed peak FLOP/s of `devices` (default: all) at `dtype`, or None when unknown (e.g. CPU)."""
    devices = jax.devices() if devices is None else devices
    peaks = device_figure(PEAK_FLOPS, devices)
    return None if peaks is None else peaks.get(dtype, peaks["float32"]) * len(devices)


def describe_devices() -> dict:
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "kind": devices[0].device_kind,
        "count": len(devices),
        "local_count": jax.local_device_count(),
        "processes": jax.process_count(),
    }
