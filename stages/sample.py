"""sample stage: complete `sample.prompts` (a base model) or answer `sample.chat_prompts` (a tuned
one) with one model, seeded, and time it.

    python stages/sample.py --params params.yaml --model runs/pretrain/model --name pretrain --format completion \
        --out runs/samples/pretrain.jsonl

`--format chat` wraps each of `sample.chat_prompts` in the chat template as a user turn (tuned models:
their SFT data asks `What is 41 plus 17?`, not the corpus's `Work out 41 plus 17:`).
"""

import json
import time

import jax

from stagelm.infer.generate import Sampling, load_generator
from stagelm.infra.errors import run_main
from stagelm.infra.files import atomic_write_bytes
from stagelm.pipeline.params import load_section, load_seed, section_dict
from stagelm.pipeline.stage import start


def main() -> None:
    options = {"name": {"required": True}, "format": {"required": True, "choices": ("completion", "chat")}}
    stage = start(__doc__, "model", "out", options=options)
    args = stage.args
    stage.name = f"sample@{args.name}"
    cfg = load_section(stage.params, "sample")
    seed = load_seed(stage.params)

    gen = load_generator(args.model)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    chat = args.format == "chat"
    records = []
    for i, prompt in enumerate(cfg.chat_prompts if chat else cfg.prompts):
        ids = gen.chat.user_prompt(prompt) if chat else gen.chat.text(prompt)
        key = jax.random.fold_in(jax.random.key(seed), i)
        gen.generate([ids], cfg.max_new_tokens, sampling, key, chat=chat)  # warm-up: compile once per shape
        t0 = time.perf_counter()
        (done,) = gen.generate([ids], cfg.max_new_tokens, sampling, key, chat=chat)
        seconds = time.perf_counter() - t0
        records.append(
            {
                "prompt": prompt,
                "format": args.format,
                "completion": done.text,
                "token_ids": done.tokens,
                "finish": done.finish,
                "tokens_per_sec": len(done.tokens) / seconds,
            }
        )
        print(f"sample@{args.name} [{i}] {prompt!r} → {done.text!r}")

    atomic_write_bytes(args.out, "".join(json.dumps(r) + "\n" for r in records).encode())
    read = {"sample": section_dict(cfg), "seed": seed, "format": args.format}
    stage.record(args.out.with_suffix(".provenance.json"), read, {"model": args.model})


if __name__ == "__main__":
    run_main(main)
