"""lm-eval's loglikelihood engine on one device: stagelm.infer.scoring.Scorer's tokens per second
against a forward pass's bound, on the SmolLM2-135M shape with random weights. Writes one JSON.

    python benchmarks/accelerator_scoring.py --out benchmarks/lm-eval-tpu-<date>.json [--shape micro]

Two workloads of random tokens, as lm-eval's multiple-choice tasks ask: `hellaswag-like`
(contexts of 80 tokens, four continuations of 20: no input shares another's prefix) and
`mmlu-like` (contexts of 600 tokens, four one-token choices: one input per item). The bound
is the device's published bf16 peak over a forward pass's FLOPs per token (a third of
`decoder.flops_per_token`'s training count at the workload's input length: 2 per matmul
parameter, the output layer included, plus causal attention), so a share of it is the
forward pass's MFU; the scorer runs the output layer at the continuation positions alone,
which this count does not credit. Times are the mean of `--repetitions` calls after one
that compiles; each call packs, transfers and scores the whole workload. `device_seconds`
times the same forward passes alone, on arrays already on the device.
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stagelm.infer.scoring import Scored, Scorer, share_prefixes  # noqa: E402
from stagelm.infra.devices import peak_flops  # noqa: E402
from stagelm.model.decoder import Decoder, DecoderConfig, flops_per_token  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, vocab_size=49152),
    "micro": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512),  # a CPU check
}
WORKLOADS = {"hellaswag-like": (80, 4, 20), "mmlu-like": (600, 4, 1)}  # context, choices, continuation tokens


def workload(context: int, choices: int, cont: int, items: int, vocab: int, rng: np.random.Generator) -> list:
    """Scored inputs of `items` multiple-choice items (request i reads its continuation's tokens)."""
    out = []
    for item in range(items):
        ctx = rng.integers(0, vocab, context).tolist()
        for c in range(choices):
            tokens = rng.integers(0, vocab, cont).tolist()
            tokens[-1] = (tokens[-1] + c) % vocab  # distinct choices
            whole = ctx + tokens
            start = len(whole) - 1 - cont
            reads = [(item * choices + c, start + j, t) for j, t in enumerate(tokens)]
            out.append(Scored(tuple(whole[:-1]), reads))
    return out


def measure(scorer: Scorer, cfg: DecoderConfig, name: str, items: int, repetitions: int) -> dict:
    context, choices, cont = WORKLOADS[name]
    work = workload(context, choices, cont, items, cfg.vocab_size, np.random.default_rng(0))
    requests = items * choices
    host = share_prefixes([w.tokens for w in work])
    tokens = sum(len(seq) for seq in set(host.values()))  # what the forward passes compute
    start = time.perf_counter()
    scorer.score(work, requests)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repetitions):
        scorer.score(work, requests)
    seconds = (time.perf_counter() - start) / repetitions
    # The device alone: the same forward passes on arrays already there, back to back.
    batches = [tuple(jax.device_put(a) for a in arrays) for arrays, _ in scorer.batches(work)]
    jax.block_until_ready([scorer.forward(b) for b in batches])
    start = time.perf_counter()
    jax.block_until_ready([scorer.forward(b) for b in batches])
    device = time.perf_counter() - start
    length = context + cont - 1
    forward = flops_per_token(cfg, length) / 3
    peak = peak_flops("bfloat16")
    return {
        "workload": name,
        "items": items,
        "requests": requests,
        "tokens_computed": tokens,
        "first_call_s": round(first, 2),
        "seconds": round(seconds, 3),
        "requests_per_s": round(requests / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        "forward_flops_per_token": forward,
        "bound_tokens_per_s": round(peak / forward) if peak else None,
        "share_of_bound": round(tokens / seconds * forward / peak, 3) if peak else None,
        "forward_passes": len(batches),
        "device_seconds": round(device, 3),
        "device_share_of_bound": round(tokens / device * forward / peak, 3) if peak else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=32, help="rows of a forward pass")
    parser.add_argument("--width", type=int, default=2048, help="the longest input the scorer takes")
    parser.add_argument("--items", type=int, default=1024)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--attention", default="auto", choices=("auto", "reference", "splash"))
    args = parser.parse_args()
    cfg = DecoderConfig(**SHAPES[args.shape], dtype="bfloat16", param_dtype="float32", attention=args.attention)
    scorer = Scorer(Decoder(cfg, nnx.Rngs(0)), args.batch_size, args.width)
    entries = []
    for name in WORKLOADS:
        try:
            entries.append(measure(scorer, cfg, name, args.items, args.repetitions))
        except Exception as err:  # out of memory, say: recorded, the next entry still runs
            entries.append({"workload": name, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        print(json.dumps(entries[-1]), flush=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "shape": args.shape,
        "dtype": "bfloat16 compute, float32 weights",
        "batch_size": args.batch_size,
        "attention": args.attention,
        "entries": entries,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
