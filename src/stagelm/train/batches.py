"""Batches on the mesh: where a training stage's batches come from, global arrays from
per-process rows, and sums over a whole split.

Every process reads only its own rows (the loader's process sharding); `global_batch`
assembles them into one global array split over the mesh's data and fsdp axes. A
`BatchSource` gives the loop its batches: packed rows through Grain (`PackedBatches`)
by default, or anything else with the same three methods (GRPO's rollouts of the
current policy, distillation's on-policy answers).
"""

from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from stagelm.data.loader import PackedRows, batch_iterator
from stagelm.infra.errors import StagelmError
from stagelm.infra.mesh import batch_sharding


def check_batch(rows: int, mesh: jax.sharding.Mesh, key: str) -> None:
    """Fail naming `key` unless `rows` (a global batch) splits evenly over the mesh's
    data-parallel devices (its data × fsdp axes) and over the processes."""
    ways = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    if rows % ways:
        raise StagelmError(
            f"{key}: {rows} rows do not split over the mesh's {ways} data-parallel devices "
            f"(mesh.data × mesh.fsdp = {dict(mesh.shape)}); give a multiple of {ways}, or set the mesh"
        )
    if rows % jax.process_count():
        raise StagelmError(f"{key}: {rows} rows do not split over {jax.process_count()} processes")


def global_batch(local: dict[str, np.ndarray], accum: int, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """(accum, rows, L) global arrays from this process's rows, split over data×fsdp."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *batch_sharding(mesh).spec))
    return {
        k: jax.make_array_from_process_local_data(sharding, v.reshape(accum, -1, v.shape[-1])) for k, v in local.items()
    }


def sum_over_split(
    fn: Callable[[dict[str, jax.Array]], Any],
    rows: PackedRows,
    batch_size: int,
    max_batches: int | None,
    mesh: jax.sharding.Mesh,
) -> Any:
    """Sum of `fn(batch)` (a pytree of scalars) over the first `max_batches` global batches of `rows`, in order.

    The last batch is padded with empty rows (segment 0), which every loss weighs 0.
    """
    local = batch_size // jax.process_count()
    it = batch_iterator(
        rows, local, 0, shard_index=jax.process_index(), shard_count=jax.process_count(), shuffle=False, num_epochs=1
    )
    total = None
    for i, batch in enumerate(it):
        if max_batches is not None and i >= max_batches:
            break
        if len(batch["tokens"]) < local:
            batch = {k: np.pad(v, ((0, local - len(v)), (0, 0))) for k, v in batch.items()}
        out = fn({k: v[0] for k, v in global_batch(batch, 1, mesh).items()})
        total = out if total is None else jax.tree.map(lambda a, b: a + b, total, out)
    return jax.tree.map(float, total)


def evaluate(
    eval_step: Any,
    params: Any,
    frozen: Any,
    rows: PackedRows,
    batch_size: int,
    max_batches: int | None,
    mesh: jax.sharding.Mesh,
) -> tuple[float, float]:
    """(token-weighted mean loss, tokens counted) of a model over the first batches of `rows`."""
    loss, weight = sum_over_split(lambda b: eval_step(params, frozen, b), rows, batch_size, max_batches, mesh)
    return loss / max(weight, 1.0), weight


class BatchSource(Protocol):
    """Where a training stage's batches come from; its state is saved in every checkpoint."""

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """(this process's rows as (rows, L) arrays, host metrics for the step's log row)."""
        ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


class PackedBatches:
    """Batches of packed rows: a seeded, process-sharded, checkpointable Grain iterator."""

    def __init__(self, rows: PackedRows, local_rows: int, seed: int):
        self.it = batch_iterator(
            rows, local_rows, seed, shard_index=jax.process_index(), shard_count=jax.process_count()
        )

    def next(self, params: Any, frozen: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        return next(self.it), {}

    def get_state(self) -> dict[str, Any]:
        return self.it.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.it.set_state(state)
