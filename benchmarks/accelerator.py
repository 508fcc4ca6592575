"""The lab on one accelerator: train-step throughput, MFU, first-step (compile) time and
memory of real model sizes, and decoding against its bandwidth bound. Writes one JSON.

    python benchmarks/accelerator.py --out benchmarks/results/accelerator-<date>.json [--only NAME ...]

benchmarks/tpu.sh runs it on a fresh TPU machine in one command (installs from local
wheels first). Every entry uses stagelm's own decoder, train step and generator
(`stagelm.measure.microbench`) with random weights and tokens, rows packed with two
documents each (so splash runs its segment path). MFU is stagelm's one count
(`decoder.flops_per_token`: MaxText's, causal attention halved) over the device's
published bf16 peak. An entry that fails (out of memory, say) records its `error` and the
run goes on; entries past `--budget` seconds are left out and say so.
"""

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagelm.infra.devices import hbm_bandwidth, peak_flops  # noqa: E402
from stagelm.measure.microbench import bench_decode, bench_train, matmul_flops  # noqa: E402
from stagelm.model.attention_kernels import splash_attention, tuning_defaults  # noqa: E402
from stagelm.model.decoder import DecoderConfig, attention, flops_per_token, row_causal_mask  # noqa: E402
from stagelm.model.footprint import dtype_bytes, param_count, train_step_bytes, training_state_bytes  # noqa: E402

SHAPES = {  # name → decoder shape and vocabulary
    "d1024-l8-h8": dict(d_model=1024, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=3584, vocab_size=32768),
    "d1024-l8-h4": dict(d_model=1024, n_layers=8, n_heads=4, n_kv_heads=4, d_ff=3584, vocab_size=32768),
    "d768-l12-h6": dict(d_model=768, n_layers=12, n_heads=6, n_kv_heads=6, d_ff=3072, vocab_size=32768),
    "gpt2-small": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048, vocab_size=32768),
    "smollm2-135m": dict(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, vocab_size=49152),
}

# (shape, seq_len, rows per micro-batch, micro-batches per step, remat, scan_layers)
RUNS = [  # the presets' shapes and the published ones, each at its fastest measured setting
    ("d1024-l8-h4", 2048, 2, 32, "none", False),  # stagelm preset tpu-150m
    ("gpt2-small", 1024, 4, 16, "none", False),
    ("smollm2-135m", 2048, 2, 32, "none", False),  # stagelm preset tpu-smollm2-135m
    ("d1024-l8-h4", 2048, 8, 8, "none", True),  # scanned: the first step's compile time
    ("gpt2-small", 1024, 4, 16, "none", True),  # 12 layers scanned
    ("smollm2-135m", 2048, 2, 32, "none", True),  # 30 layers scanned
]
DECODE = ("smollm2-135m", (1, 8, 64), 128, 128)  # shape, batches, prompt and new tokens


def splash_check(tuning: dict, t: int = 1024, heads: int = 8, kv_heads: int = 2, head_dim: int = 128) -> dict:
    """The compiled splash kernel (set by `tuning`) against the reference on this device: packed rows
    with padding, grouped heads, float32 inputs at the highest matmul precision; the largest differences."""
    seg = np.ones((2, t), np.int32)
    seg[0, t // 3 :], seg[0, t - 50 :] = 2, 0
    pos = np.stack([np.concatenate([np.arange(t // 3), np.arange(t - t // 3)]), np.arange(t)])
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, t, heads, head_dim))
    k, v = (jax.random.normal(key, (2, t, kv_heads, head_dim)) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape)
    mask = row_causal_mask(jnp.asarray(seg), jnp.asarray(pos))
    settings = tuple(tuning.items())

    def ref(q, k, v):
        return jnp.sum(attention(q, k, v, mask, causal=True) * w)

    def fast(q, k, v):
        return jnp.sum(splash_attention(q, k, v, jnp.asarray(seg), settings) * w)

    with jax.default_matmul_precision("highest"):
        out_ref = jax.jit(lambda *a: attention(a[0], a[1], a[2], mask, causal=True))(q, k, v)
        out = jax.jit(lambda *a: splash_attention(*a, jnp.asarray(seg), settings))(q, k, v)
        g_ref = jax.jit(jax.grad(ref, (0, 1, 2)))(q, k, v)
        g = jax.jit(jax.grad(fast, (0, 1, 2)))(q, k, v)
    return {
        "seq_len": t,
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "head_dim": head_dim,
        "max_abs_diff_out": float(jnp.max(jnp.abs(out - out_ref))),
        "max_abs_diff_grads": [float(jnp.max(jnp.abs(a - b))) for a, b in zip(g, g_ref, strict=True)],
        "max_abs_grads": [float(jnp.max(jnp.abs(a))) for a in g_ref],
    }


def train_entry(
    name: str,
    seq_len: int,
    batch: int,
    accum: int,
    remat: str,
    scan: bool,
    steps: int,
    tuning: dict,
    profile: bool = False,
) -> dict:
    shape = SHAPES[name]
    cfg = DecoderConfig(
        **shape,
        dtype="bfloat16",
        param_dtype="float32",
        remat=remat,
        scan_layers=scan,
        splash_tuning=tuple(tuning.items()),
    )
    entry = {
        "name": name,
        "device_kind": jax.devices()[0].device_kind,
        **{k: shape[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size")},
        "head_dim": cfg.head_dim,
        "seq_len": seq_len,
        "batch": batch * accum,
        "micro_batch": batch,
        "accumulation": accum,
        "remat": remat,
        "scan_layers": scan,
        "attention": "auto",
        "splash": tuning_defaults(cfg.head_dim) | tuning,  # what the kernel ran
        "dtype": cfg.dtype,
        "params": param_count(**shape),
    }
    compiled = {}

    def memory(step, state, frozen, rows) -> None:  # compiles the step (the first call reuses it)
        t0 = time.perf_counter()
        stats = step.lower(state, frozen, rows).compile().memory_analysis()
        compiled["seconds"] = time.perf_counter() - t0
        compiled["bytes"] = (
            stats.temp_size_in_bytes
            + stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            - stats.alias_size_in_bytes
        )

    try:
        with tempfile.TemporaryDirectory() as trace:
            out = bench_train(
                cfg, seq_len, batch, 1, steps, accumulation=accum, check=memory, trace_dir=trace if profile else None
            )
    except Exception as exc:  # noqa: BLE001 - a shape that does not fit is a result; the run goes on
        entry["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        return entry
    step_s = float(np.median(out["step_seconds"]))
    entry["first_step_seconds"] = compiled["seconds"] + out["first_call_seconds"]
    entry["step_seconds"] = step_s
    entry["tokens_per_sec"] = batch * accum * seq_len / step_s
    entry["flops_per_token"] = flops_per_token(cfg, seq_len)
    entry["mfu"] = entry["tokens_per_sec"] * entry["flops_per_token"] / peak_flops("bfloat16")
    entry["compiled_bytes"] = compiled["bytes"]  # XLA's figure: arguments, temporaries and outputs of the step
    entry["estimated_bytes"] = training_state_bytes(entry["params"], cfg.param_dtype) + train_step_bytes(
        cfg, batch, seq_len
    )
    if profile:
        entry["profile"] = out["profile"]  # where one step's device time goes, by XLA op
    return entry


def decode_entries(name: str, batches: tuple, prompt: int, new: int) -> list[dict]:
    shape = SHAPES[name]
    cfg = DecoderConfig(**shape, dtype="bfloat16", param_dtype="bfloat16")
    weight_bytes = param_count(**shape) * dtype_bytes("bfloat16")
    entries = []
    for batch in batches:
        out = bench_decode(cfg, batch, prompt, new, 1, 5)
        tps = batch * new / float(np.median(out["cached_seconds"]))
        bound = hbm_bandwidth() / weight_bytes * batch  # every step streams the weights once
        entries.append(
            {
                "name": name,
                "device_kind": jax.devices()[0].device_kind,
                "decode_batch": batch,
                "prompt_len": prompt,
                "new_tokens": new,
                "weight_bytes": weight_bytes,
                "tokens_per_sec": tps,
                "bandwidth_bound_tokens_per_sec": bound,
                "fraction_of_bound": tps / bound,
            }
        )
    return entries


def parse_tuning(text: str) -> dict:
    """`fused_bwd:1,block_q:1024,k_layout:SEQ_MINOR` → {"fused_bwd": 1, "block_q": 1024, "k_layout": "SEQ_MINOR"}."""
    pairs = (item.split(":", 1) for item in text.split(",") if item)
    return {key: int(value) if value.isdigit() else value for key, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per entry (after one warm-up)")
    parser.add_argument("--no-decode", action="store_true", help="train entries only")
    parser.add_argument("--unscanned", action="store_true", help="leave out the scanned entries")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each train entry")
    parser.add_argument(
        "--splash",
        nargs="*",
        default=[""],
        metavar="KEY:VALUE,...",
        help="splash kernel settings to run each train entry with (DecoderConfig.splash_tuning), e.g. fused_bwd:1",
    )
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later entries are left out")
    args = parser.parse_args()
    start = time.perf_counter()
    result = {
        "date": datetime.date.today().isoformat(),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "peak_flops_bf16": peak_flops("bfloat16"),
        "hbm_bandwidth": hbm_bandwidth(),
        "matmul_bf16_8192_flops_per_sec": float(np.median(matmul_flops(8192, "bfloat16", 2, 10))),
        "splash_check": [],  # the compiled kernel against the reference, with each --splash setting
        "train": [],
        "decode": [],
        "left_out": [],
    }
    for tuning in args.splash if jax.default_backend() == "tpu" else ():
        result["splash_check"].append({"splash": tuning, **splash_check(parse_tuning(tuning))})
    for name, seq_len, batch, accum, remat, scan in RUNS:
        if args.only and name not in args.only or args.unscanned and scan:
            continue
        for tuning in args.splash:
            if time.perf_counter() - start > args.budget:
                left = dict(name=name, seq_len=seq_len, batch=batch, accumulation=accum, remat=remat, splash=tuning)
                result["left_out"].append(left)
                continue
            entry = train_entry(
                name, seq_len, batch, accum, remat, scan, args.steps, parse_tuning(tuning), args.profile
            )
            print(json.dumps(entry), flush=True)
            result["train"].append(entry)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    name, batches, prompt, new = DECODE
    if not args.no_decode and (not args.only or name in args.only):
        result["decode"] = decode_entries(name, batches, prompt, new)
        print(json.dumps(result["decode"]), flush=True)
    result["seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
