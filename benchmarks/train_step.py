"""Time stagelm's train step on the peer reference's config (dev script, not a test).

    python benchmarks/train_step.py                 # tiny preset: the reference's default
    python benchmarks/train_step.py --reps 20 --dtype bfloat16

Prints one JSON line: median tokens/s over timed steps after warm-up, first-call
(compile) time apart, and the timed steps' page faults and kernel time. It starts itself
again with huge pages for malloc as the stages do (src/stagelm/infra/hugepages.py);
`GLIBC_TUNABLES=glibc.malloc.hugetlb=0` times it without. Run it back to back with
../shared/bench/torch_reference.py (see benchmarks/README.md) and compare medians from
the same run.
"""

import argparse
import json
import os
import resource
import statistics
import time

import jax
import numpy as np
from flax import nnx

from stagelm.infra.hugepages import restart_with_huge_pages
from stagelm.measure.microbench import bench_optimizer
from stagelm.model.decoder import Decoder, DecoderConfig, flops_per_token
from stagelm.train.step import init_state, make_optimizer, make_train_step

PRESETS = {
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=688, seq_len=256, batch=16),
    "small": dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1376, seq_len=512, batch=8),
}


def main() -> None:
    restart_with_huge_pages()  # as every stage runs (src/stagelm/infra/hugepages.py)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    c = dict(PRESETS[args.preset])
    seq_len, batch = c.pop("seq_len"), c.pop("batch")
    cfg = DecoderConfig(**c, dtype=args.dtype)
    model = Decoder(cfg, nnx.Rngs(0))
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(bench_optimizer(args.warmup + args.reps + 1), params)
    state = init_state(params, tx, jax.random.key(0))
    step = make_train_step(graphdef, tx)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, batch, seq_len + 1)).astype(np.int32)
    b = {
        "tokens": tokens,
        "segment_ids": np.ones_like(tokens),
        "positions": np.broadcast_to(np.arange(seq_len + 1, dtype=np.int32), tokens.shape).copy(),
    }
    b = jax.device_put(b)

    t0 = time.perf_counter()
    state, m = step(state, frozen, b)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    times, usage = [], []
    for i in range(args.warmup + args.reps):
        if i == args.warmup:
            usage.append(resource.getrusage(resource.RUSAGE_SELF))
        t0 = time.perf_counter()
        state, m = step(state, frozen, b)
        jax.block_until_ready(m)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    usage.append(resource.getrusage(resource.RUSAGE_SELF))
    before, after = usage
    n = batch * seq_len
    median = statistics.median(times)
    print(
        json.dumps(
            {
                "name": "stagelm_train_step",
                "tokens_per_sec_median": n / median,
                "tokens_per_sec_min": n / max(times),
                "tokens_per_sec_max": n / min(times),
                "seconds_median": median,
                "first_call_seconds": first,
                # per timed step: page faults and kernel time (src/stagelm/infra/hugepages.py)
                "minor_faults_per_step": (after.ru_minflt - before.ru_minflt) / len(times),
                "system_seconds_per_step": (after.ru_stime - before.ru_stime) / len(times),
                "user_seconds_per_step": (after.ru_utime - before.ru_utime) / len(times),
                "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
                "reps": len(times),
                "gflop_per_sec_median": flops_per_token(cfg, seq_len) * n / median / 1e9,
                "jax": jax.__version__,
                "preset": args.preset,
                "dtype": args.dtype,
            }
        )
    )


if __name__ == "__main__":
    main()
