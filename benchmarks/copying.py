"""Can the pipeline's decoder learn to copy from its context? A control for issue 19.

    python benchmarks/copying.py [--vocab 870] [--d-model 128] [--layers 4] [--seq-len 256] [--span 24] [--steps 200]

Trains `stagelm.model.decoder.Decoder` (the default model shape, the pretrain stage's AdamW
settings: lr 3e-3, beta2 0.95, weight decay 0.1, clip 1.0, no schedule) on rows made
only of random token spans each written twice, and prints every 25 steps the loss on
the second copies: it starts at ln(vocab) and falls towards 0 once attention has
learned to look the next token up in the first copy (an induction head). The default
pipeline's corpus mixes such copying into stories and sheets far more thinly; there,
400 steps did not form it (docs/default-run.md, "The default recipe, and why").
"""

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stagelm.model.decoder import Decoder, DecoderConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=870)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--span", type=int, default=24)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    cfg = DecoderConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=2,
        d_ff=3 * args.d_model,
    )
    model = Decoder(cfg, nnx.Rngs(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, b2=0.95, weight_decay=0.1))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(0)

    @nnx.jit
    def step(model: Decoder, opt: nnx.Optimizer, tokens: jnp.ndarray, second: jnp.ndarray) -> tuple:
        def loss_fn(m: Decoder) -> tuple:
            inputs = tokens[:, :-1]
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
            logits = m(inputs, jnp.ones_like(inputs), positions).astype(jnp.float32)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return nll.mean(), (nll * second).sum() / second.sum()

        (loss, copied), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return loss, copied

    def batch() -> tuple[jnp.ndarray, jnp.ndarray]:
        rows, masks = [], []
        for _ in range(args.batch):
            row: list[int] = []
            mask: list[int] = []
            while len(row) < args.seq_len + 1:
                span = rng.integers(0, args.vocab, size=args.span).tolist()
                row += span + span
                mask += [0] * args.span + [1] * args.span
            rows.append(row[: args.seq_len + 1])
            masks.append(mask[1 : args.seq_len + 1])  # mask[i] marks target i + 1
        return jnp.asarray(rows, jnp.int32), jnp.asarray(masks, jnp.float32)

    print(f"| step | loss | loss on the second copies (ln vocab = {np.log(args.vocab):.2f}) |\n|---|---|---|")
    for i in range(args.steps + 1):
        loss, copied = step(model, opt, *batch())
        if i % 25 == 0:
            print(f"| {i} | {float(loss):.3f} | {float(copied):.3f} |", flush=True)


if __name__ == "__main__":
    main()
