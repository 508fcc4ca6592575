"""Decode speed: KV-cached generation against naive full-prefix recomputation (dev script).

    python benchmarks/decode.py --model runs/pretrain/model        # the default pipeline's model
    python benchmarks/decode.py --preset tiny                       # random weights, the torch reference's config

Greedy, a 16-token prompt, 128 new tokens, batch 1 and 8; medians over --reps after
one warm-up call. Prints one JSON line per measurement. GRPO's rollouts of the default
pipeline (256 samples of up to 40 tokens, at temperature 1):

    python benchmarks/decode.py --preset default --batches 256 --prompt-len 24 --new-tokens 40 --temperature 1
"""

import argparse
import json
import statistics

import jax
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, models

from stagelm.infer.generate import Generator, Sampling, load_generator
from stagelm.measure.timing import timed
from stagelm.model.decoder import Decoder, DecoderConfig

PRESETS = {
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=688),
    "default": dict(vocab_size=848, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384),  # params.yaml's
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a stagelm model directory")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--naive", action="store_true", help="also time naive full-prefix recomputation")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args()
    if args.model:
        gen = load_generator(args.model)
    else:
        cfg = DecoderConfig(**PRESETS[args.preset or "tiny"])
        vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
        gen = Generator(Decoder(cfg, nnx.Rngs(0)), Tokenizer(models.WordLevel(vocab, "t0")), 256)
    vocab = gen.model.cfg.vocab_size
    rng = np.random.default_rng(0)
    sampling = Sampling(temperature=args.temperature)
    for batch in args.batches:
        prompts = rng.integers(10, vocab, (batch, args.prompt_len)).tolist()

        def cached(prompts=prompts):
            return gen.generate(prompts, args.new_tokens, sampling, until_stop=False)

        times = timed(cached, 1, args.reps)
        rates = {"cached": batch * args.new_tokens / statistics.median(times)}
        if args.naive:
            naive_times = timed(lambda p=prompts: jax.block_until_ready(gen.naive_generate(p, args.new_tokens)), 1, 2)
            rates["naive"] = batch * args.new_tokens / statistics.median(naive_times)
        layout = gen.layout(prompts, args.new_tokens)
        prefill = statistics.median(
            timed(lambda layout=layout: jax.block_until_ready(gen._prefill(gen.params, *layout)), 1, args.reps)
        )
        print(
            json.dumps(
                {
                    "batch": batch,
                    "new_tokens": args.new_tokens,
                    "prompt_len": args.prompt_len,
                    "temperature": args.temperature,
                    **{f"{k}_tokens_per_sec": v for k, v in rates.items()},
                    "speedup": rates["cached"] / rates["naive"] if "naive" in rates else None,
                    "prefill_seconds": prefill,
                    "model": args.model or args.preset or "tiny",
                }
            )
        )


if __name__ == "__main__":
    main()
