"""Does a trained model copy from its context? The log-probability it gives the tokens it could copy.

    python benchmarks/copy_probe.py runs/pretrain/model data/raw [--documents 60]

Reads the corpus val split (`<raw>/corpus_val.parquet`) and scores, with one forward
pass per document, two kinds of tokens a model can only predict well by looking back:

- uses_word sheets: the person's name and the word where each answer writes them
  (`A sentence about Ella with the word blanket in at most 5 words: Ella found a blanket.`);
- stories: every name token, first mentions apart from repeats (a repeat is a name the
  story has already written).

Chance is ln(1/24) = -3.18 for a name and ln(1/48) = -3.87 for a training-pool word; a
model that copies puts most of the mass there (p > 0.5). docs/default-run.md ("The default recipe,
and why") has what the default run and the tried corpus changes give.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
from flax import nnx

from stagelm.data.tokenizer import load_tokenizer
from stagelm.model.modeldir import load_model
from stagelm.post.grpo import token_logprobs
from stagelm.tasks.words import NAMES

NAME_TOKENS = {"Ġ" + n for n in NAMES} | set(NAMES)


def make_scorer(model, length: int):
    """ids → log p(token i | tokens < i) for i >= 1, as (len(ids) - 1,). One compiled forward
    pass for every document: each is padded to `length` with a segment of its own, which
    the causal mask keeps from changing the document's logits."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def logprobs(params, x: jax.Array, segments: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(x, segments, jnp.arange(length, dtype=jnp.int32)[None])[0]
        return token_logprobs(logits[:-1], x[0, 1:])

    def score(ids: list[int]) -> np.ndarray:
        x = np.zeros((1, length), np.int32)
        x[0, : len(ids)] = ids
        segments = np.zeros((1, length), np.int32)
        segments[0, : len(ids)] = 1
        return np.asarray(logprobs(params, x, segments))[: len(ids) - 1]

    return score


def sheet_slots(tokens: list[str]) -> list[tuple[int, str]]:
    """(index, "name" | "word") of the answer tokens that repeat the prompt's name or word."""
    slots = []
    for i in range(1, len(tokens)):
        if tokens[i - 1] != ":":
            continue
        about = max(k for k in range(i) if tokens[k] == "Ġabout")
        name, word = tokens[about + 1].lstrip("Ġ"), tokens[about + 5]
        for k in range(i, len(tokens)):
            if tokens[k] == ".":
                break
            if tokens[k].lstrip("Ġ") == name:
                slots.append((k, "name"))
            elif tokens[k] == word:
                slots.append((k, "word"))
    return slots


def story_slots(tokens: list[str]) -> list[tuple[int, str]]:
    slots, seen = [], set()
    for i, t in enumerate(tokens[1:], start=1):
        if t in NAME_TOKENS:
            bare = t.lstrip("Ġ")
            slots.append((i, "story name, repeat" if bare in seen else "story name, first"))
            seen.add(bare)
    return slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("raw")
    parser.add_argument("--documents", type=int, default=60, help="of each kind")
    args = parser.parse_args()

    model = load_model(args.model)
    tok = load_tokenizer(f"{args.model}/tokenizer.json")
    texts = pq.read_table(f"{args.raw}/corpus_val.parquet", columns=["text"]).column("text").to_pylist()
    sheets = [t for t in texts if "with the word" in t][: args.documents]
    stories = [t for t in texts if "with the word" not in t and "Work out" not in t][: args.documents]

    score = make_scorer(model, max(len(tok.encode(t).ids) for t in sheets + stories))
    found: dict[str, list[float]] = {}
    for texts_, slots_of in ((sheets, sheet_slots), (stories, story_slots)):
        for text in texts_:
            enc = tok.encode(text)
            lp = score(enc.ids)
            for index, kind in slots_of(enc.tokens):
                found.setdefault(kind, []).append(float(lp[index - 1]))
    print("| tokens | n | mean log p | share with p > 0.5 |\n|---|---|---|---|")
    for kind, values in found.items():
        v = np.array(values)
        print(f"| {kind} | {len(v)} | {v.mean():.2f} | {(np.exp(v) > 0.5).mean():.2f} |")


if __name__ == "__main__":
    main()
