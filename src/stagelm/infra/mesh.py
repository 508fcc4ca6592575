"""The device mesh and the logical-axis rules that shard params, state and batches on it.

Three named mesh axes: `data` (replicas that split the batch), `fsdp` (split the batch
and shard params and optimizer state, ZeRO-3 style) and `tensor` (split attention
heads, the MLP hidden width and the vocab, Megatron style). Model code names
logical axes only; this table (after MaxText's `logical_axis_rules`) maps them:
"""

import math
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stagelm.infra.errors import StagelmError

MESH_AXES = ("data", "fsdp", "tensor")
RULES: dict[str | None, Any] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "seq": None,
    "embed_act": None,
    None: None,
}


def make_mesh(data: int, fsdp: int, tensor: int, devices: list | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all); one size may be -1 (inferred)."""
    devices = jax.devices() if devices is None else devices
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    unknown = [k for k, v in sizes.items() if v == -1]
    if len(unknown) > 1:
        raise StagelmError(f"mesh.{unknown[1]}: only one mesh axis may be -1")
    known = math.prod(v for v in sizes.values() if v != -1)
    if unknown:
        if len(devices) % known:
            raise StagelmError(f"mesh.{unknown[0]}: {len(devices)} devices do not divide by the other axes ({known})")
        sizes[unknown[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise StagelmError(f"mesh: data×fsdp×tensor = {math.prod(sizes.values())} but there are {len(devices)} devices")
    grid = np.asarray(devices).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(grid, MESH_AXES)


def logical_spec(axes: tuple | None) -> PartitionSpec:
    """The PartitionSpec of a tuple of logical axis names."""
    if axes is None:
        return PartitionSpec()
    return PartitionSpec(*(RULES[a] for a in axes))


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drop the mesh axes of `spec` that do not divide their dimension (keeps odd sizes replicated)."""
    parts = []
    for dim, part in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = (part,) if isinstance(part, str) else tuple(part or ())
        kept = tuple(n for n in names if dim % mesh.shape[n] == 0 and mesh.shape[n] > 1)
        parts.append(kept[0] if len(kept) == 1 else (kept or None))
    return PartitionSpec(*parts)


def param_shardings(state: Any, mesh: Mesh) -> Any:
    """The NamedSharding of each array of an nnx.State, from the logical `axes` metadata of its Variable.

    The result has the state's own structure (Variables holding shardings), so it
    serves device_put, jit shardings and Orbax restore targets alike.
    """
    from flax import nnx

    def one(v: Any) -> Any:
        spec = logical_spec(v.get_metadata().get("axes"))
        return v.replace(NamedSharding(mesh, fit_spec(spec, v.shape, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows split over data×fsdp, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(RULES["batch"], *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
    """Pin an activation's sharding by logical axes when tracing under a mesh (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = fit_spec(logical_spec(axes), x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of a global array as numpy, on every process (gathered when other processes hold parts)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mine(rows: np.ndarray) -> np.ndarray:
    """This process's share of rows every process holds alike (its contiguous slice of the first axis)."""
    share = len(rows) // jax.process_count()
    return rows[jax.process_index() * share : (jax.process_index() + 1) * share]
