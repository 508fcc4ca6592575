"""The decode-attention kernel alone against XLA's slot-major attention, on one device: a
decode step's 30 layers of attention at the SmolLM2-135M shape (9 query heads, 3 k/v heads of
64, bf16), per batch and kernel block, with a check of the kernel's output against the reference.

    PYTHONPATH=src python benchmarks/decode_kernel.py [--batches 64 256] [--filled 192]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagelm.model import decode_attention as decode_attention_module  # noqa: E402
from stagelm.model.decode_attention import decode_attention  # noqa: E402
from stagelm.model.kvcache import slot_major_attention  # noqa: E402

H, K, DH, LAYERS, SLOTS = 9, 3, 64, 30, 256


def use_blocks(spec: str) -> tuple[int, int]:
    """(rows, slots) of "RxS" (BlockSpec blocks of R rows by S slots) or "RpC" (R rows, the kernel
    fetching their filled chunks of C slots itself), the fetch set in `decode_attention`."""
    fetch, sep = ("prefix", "p") if "p" in spec else ("blocks", "x")
    decode_attention_module.FETCH = fetch
    rows, slots = map(int, spec.split(sep))
    return rows, slots


def inputs(batch: int, filled: int) -> tuple:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, 1, H, DH), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, SLOTS, K * DH), jnp.bfloat16) for key in keys[1:])
    visible = np.arange(SLOTS)[None] < filled
    visible = visible & (np.arange(SLOTS)[None] >= np.arange(batch)[:, None] % 40)  # some left padding
    return q, k, v, jnp.asarray(visible)[:, None, None, :]


def layers(attend):
    """LAYERS applications in a loop, each on the last one's output (so none is hoisted)."""

    def run(q, k, v, mask, filled):
        body = lambda _, q: attend(q, k, v, mask, filled)  # noqa: E731
        return jax.lax.fori_loop(0, LAYERS, body, q)

    return jax.jit(run)


def ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--filled", type=int, default=192)
    parser.add_argument(
        "--blocks",
        default="8x64,8x128,16x64,16x128,32x64",
        help="rows x slots a grid step, or rows p chunk (prefix fetch)",
    )
    args = parser.parse_args()
    out = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "filled": args.filled, "runs": []}
    for batch in args.batches:
        q, k, v, mask = inputs(batch, args.filled)
        filled = jnp.int32(args.filled)
        reference = layers(lambda q, k, v, m, f: slot_major_attention(q, k, v, m))
        row = {"batch": batch, "reference_ms": ms(reference, q, k, v, mask, filled)}
        want = slot_major_attention(q, k, v, mask).astype(jnp.float32)
        for spec in args.blocks.split(","):
            rows, slots = use_blocks(spec)
            kernel = layers(lambda q, k, v, m, f, r=rows, s=slots: decode_attention(q, k, v, m, f, s, r))
            try:
                got = decode_attention(q, k, v, mask, filled, slots, rows).astype(jnp.float32)
                diff = float(jnp.max(jnp.abs(got - want)))
                row[spec] = {"ms": ms(kernel, q, k, v, mask, filled), "max_abs_diff": diff}
            except Exception as e:  # a block shape the compiler refuses: recorded, the others still run
                row[spec] = {"ms": float("inf"), "error": str(e)[:300]}
        print(json.dumps(row), flush=True)
        out["runs"].append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
