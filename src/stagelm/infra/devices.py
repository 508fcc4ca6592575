"""What the devices can do: published peak FLOP/s per accelerator, for MFU.

Peaks are dense (no sparsity) figures from the vendors' data sheets. CPUs have no
entry: their MFU is measured against a large jitted matmul instead (benchmark stage).
"""

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


def peak_flops(dtype: str, devices: list | None = None) -> float | None:
    """Summed peak FLOP/s of `devices` (default: all) at `dtype`, or None when unknown (e.g. CPU)."""
    devices = jax.devices() if devices is None else devices
    kind = devices[0].device_kind
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return peaks.get(dtype, peaks["float32"]) * len(devices)
    return None


def describe_devices() -> dict:
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "kind": devices[0].device_kind,
        "count": len(devices),
        "local_count": jax.local_device_count(),
        "processes": jax.process_count(),
    }
