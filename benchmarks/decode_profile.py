"""Where a batched decode step's device time goes: the SmolLM2-135M shape, bf16, random weights.

    python benchmarks/decode_profile.py --out benchmarks/decode-profile-<date>.json [--batches 1 8 64 256]

For each batch: greedy generation of --new tokens after a --prompt-token prompt (stagelm's
`Generator.generate`, fixed length), its tokens/s against the bandwidth bound (every step
streams the weights once, as benchmarks/accelerator.py counts it, and, beside it, the bound
that also reads the cache's filled slots), the prefill's time, and with --profile the
device time of one generation by XLA op (`microbench.device_time_by_op`) and by op
signature (`by_signature`: an op's HLO text without its instruction numbers, so that the
same op of every layer adds up). Every batch is compiled first, all at once (`warm`:
XLA compiles in the threads in parallel), so `first_call_seconds` overlap. On a fresh TPU
machine, with the wheels its index lacks in .whl-tpu/ (ruamel.yaml: benchmarks/README.md):

    STAGELM_SCRIPT=benchmarks/decode_profile.py bash benchmarks/tpu.sh --out decode.json
"""

import argparse
import datetime
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagelm.infra.devices import hbm_bandwidth  # noqa: E402
from stagelm.measure.microbench import device_time_by_op  # noqa: E402
from stagelm.measure.timing import timed  # noqa: E402
from stagelm.model import decode_attention  # noqa: E402
from stagelm.model.attention_kernels import decode_kernel_for  # noqa: E402
from stagelm.model.decoder import DecoderConfig  # noqa: E402
from stagelm.model.footprint import dtype_bytes, param_count  # noqa: E402

SHAPE = dict(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, vocab_size=49152)


def random_prompts(gen, batch: int, prompt: int) -> list[list[int]]:
    return np.random.default_rng(1).integers(10, gen.model.cfg.vocab_size, (batch, prompt)).tolist()


def warm(gen, batches: list[int], prompt: int, new: int) -> dict[int, float]:
    """Seconds to each batch's first generation and prefill, all compiled at once in threads."""

    def first(batch: int) -> float:
        t0 = time.perf_counter()
        prompts = random_prompts(gen, batch, prompt)
        gen.generate(prompts, new, until_stop=False)
        jax.block_until_ready(gen._prefill(gen.params, *gen.layout(prompts, new)))
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(batches)) as pool:
        return dict(zip(batches, pool.map(first, batches), strict=True))


def by_signature(trace: str, top: int = 30) -> list:
    """[HLO text without instruction numbers, share of the device time, ops] of the `top` largest
    signatures of a trace: the same op of every layer and step adds up."""
    from jax.profiler import ProfileData

    seconds: dict[str, list] = {}
    for path in sorted(Path(trace).rglob("*.xplane.pb")):
        for plane in ProfileData.from_file(str(path)).planes:
            device = plane.name.startswith("/device:")
            for event in (e for line in plane.lines if device and line.name == "XLA Ops" for e in line.events):
                if event.name.split(" = ")[0].lstrip("%").startswith("while"):
                    continue  # a loop's time is its body's ops'
                key = re.sub(r"(%[\w\-.]+?)(\.\d+)+\b", r"\1", event.name)[:300]
                seconds.setdefault(key, [0.0, set()])
                seconds[key][0] += event.duration_ns / 1e9
                seconds[key][1].add(event.name.split(" = ")[0])
    total = sum(s for s, _ in seconds.values()) or 1.0
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1][0])[:top]
    return [[key, round(s / total, 4), len(ops)] for key, (s, ops) in ranked]


def entry(gen, batch: int, prompt: int, new: int, profile: bool, first: float) -> dict:
    cfg = gen.model.cfg
    prompts = random_prompts(gen, batch, prompt)

    def run() -> None:
        gen.generate(prompts, new, until_stop=False)

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
        "decode_step_ms": (seconds - prefill) / new * 1e3,
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
            out["profile"]["by_signature"] = by_signature(trace)
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
    parser.add_argument("--note", default="", help="what was run, kept in the output")
    parser.add_argument("--blocks", default="", help="the decode kernel's rows x slots a grid step (default: its own)")
    args = parser.parse_args()
    if args.blocks:  # RxS: BlockSpec blocks of R rows by S slots; RpC: the kernel fetches chunks of C itself
        decode_attention.FETCH, sep = ("prefix", "p") if "p" in args.blocks else ("blocks", "x")
        decode_attention.ROW_BLOCK, decode_attention.SLOT_BLOCK = map(int, args.blocks.split(sep))
    cfg = DecoderConfig(**SHAPE, dtype="bfloat16", param_dtype="bfloat16")
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    gen = Generator(Decoder(cfg, nnx.Rngs(0)), Tokenizer(models.WordLevel(vocab, "t0")), args.prompt + args.new)
    result = {
        "date": datetime.date.today().isoformat(),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "hbm_bandwidth": hbm_bandwidth(),
        "note": args.note,
        "decode_kernel": decode_kernel_for(cfg.attention),  # attention_kernels: `decode` (Pallas) or `reference`
        "decode_kernel_blocks": f"{decode_attention.ROW_BLOCK}x{decode_attention.SLOT_BLOCK}",
        "decode_kernel_fetch": decode_attention.FETCH,
        "decode": [],
    }
    t0 = time.perf_counter()
    firsts = warm(gen, args.batches, args.prompt, args.new)
    print(f"compiled every batch in {time.perf_counter() - t0:.1f} s", flush=True)
    for batch in args.batches:
        e = entry(gen, batch, args.prompt, args.new, batch in args.profile, firsts[batch])
        print(json.dumps({k: v for k, v in e.items() if k != "profile"}), flush=True)
        if "profile" in e:
            print(json.dumps(e["profile"]["by_signature"][:12], indent=0)[:4000], flush=True)
        result["decode"].append(e)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
