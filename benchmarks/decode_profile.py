"""Where a batched decode step's device time goes: the SmolLM2-135M shape, bf16, random weights.

    python benchmarks/decode_profile.py --out benchmarks/decode-profile-<date>.json [--batches 1 8 64 256]

For each batch: greedy generation of --new tokens after a --prompt-token prompt (stagelm's
`Generator.generate`, fixed length), its tokens/s against the bandwidth bound (every step
streams the weights once, as benchmarks/accelerator.py counts it, and, beside it, the bound
that also reads the cache's filled slots), the prefill's time, and with --profile the
device time of one generation by XLA op (`microbench.device_time_by_op`). On a fresh TPU
machine, with the wheels its index lacks in .whl-tpu/ (ruamel.yaml: benchmarks/README.md):

    STAGELM_SCRIPT=benchmarks/decode_profile.py bash benchmarks/tpu.sh --out decode.json
"""

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagelm.infra.devices import hbm_bandwidth  # noqa: E402
from stagelm.measure.microbench import device_time_by_op  # noqa: E402
from stagelm.measure.timing import timed  # noqa: E402
from stagelm.model.decoder import DecoderConfig  # noqa: E402
from stagelm.model.footprint import dtype_bytes, param_count  # noqa: E402

SHAPE = dict(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, vocab_size=49152)


def entry(gen, batch: int, prompt: int, new: int, profile: bool) -> dict:
    cfg = gen.model.cfg
    prompts = np.random.default_rng(1).integers(10, cfg.vocab_size, (batch, prompt)).tolist()

    def run() -> None:
        gen.generate(prompts, new, until_stop=False)

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    seconds = statistics.median(timed(run, 1, 5))
    layout = gen.layout(prompts, new)
    prefill = statistics.median(timed(lambda: jax.block_until_ready(gen._prefill(gen.params, *layout)), 1, 5))
    weight_bytes = param_count(**SHAPE) * dtype_bytes("bfloat16")
    cache_bytes_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes("bfloat16")
    mean_filled = prompt + new / 2
    bandwidth = hbm_bandwidth() or float("nan")
    out = {
        "batch": batch,
        "prompt_len": prompt,
        "new_tokens": new,
        "first_call_seconds": first,
        "seconds": seconds,
        "prefill_seconds": prefill,
        "tokens_per_sec": batch * new / seconds,
        "decode_tokens_per_sec": batch * new / max(seconds - prefill, 1e-9),
        "bandwidth_bound_tokens_per_sec": bandwidth / weight_bytes * batch,
        "bound_with_cache_tokens_per_sec": bandwidth
        / (weight_bytes + batch * mean_filled * cache_bytes_per_token)
        * batch,
    }
    out["fraction_of_bound"] = out["tokens_per_sec"] / out["bandwidth_bound_tokens_per_sec"]
    if profile:
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace):
                run()
            out["profile"] = device_time_by_op(trace)
    return out


def main() -> None:
    from flax import nnx
    from tokenizers import Tokenizer, models

    from stagelm.infer.generate import Generator
    from stagelm.model.decoder import Decoder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--profile", type=int, nargs="*", default=[64], help="batches to profile")
    args = parser.parse_args()
    cfg = DecoderConfig(**SHAPE, dtype="bfloat16", param_dtype="bfloat16")
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    gen = Generator(Decoder(cfg, nnx.Rngs(0)), Tokenizer(models.WordLevel(vocab, "t0")), args.prompt + args.new)
    result = {
        "date": datetime.date.today().isoformat(),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "hbm_bandwidth": hbm_bandwidth(),
        "decode": [],
    }
    for batch in args.batches:
        e = entry(gen, batch, args.prompt, args.new, batch in args.profile)
        print(json.dumps({k: v for k, v in e.items() if k != "profile"}), flush=True)
        if "profile" in e:
            print(json.dumps(e["profile"], indent=1)[:6000], flush=True)
        result["decode"].append(e)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
