"""Pack throughput against raw `Tokenizer.encode_batch` on the same text (dev script).

    python benchmarks/pack_speed.py --raw data/raw --tokenizer data/tokenizer/tokenizer.json

Times, on the training split: `encode_batch` alone (what the tokenizers library can
do), and the pack stage's work (encode, pack into rows, write Arrow shards + manifest).
Prints one JSON line with tokens/s for both and their ratio (best of --reps).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from stagelm.data.chatformat import ChatFormat
from stagelm.data.pack import ShardWriter, pack_corpus
from stagelm.data.rawdata import iter_column, read_raw
from stagelm.data.tokenizer import load_tokenizer


def best_of(reps: int, fn) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raw", type=Path, default=Path("data/raw"))
    parser.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer/tokenizer.json"))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    texts = read_raw(args.raw, "corpus_train").column("text").to_pylist()
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))

    raw_s = best_of(args.reps, lambda: tok.encode_batch(texts, add_special_tokens=False))
    with tempfile.TemporaryDirectory() as tmp:

        def pack() -> None:  # as the stage does: streamed from the Parquet file
            batches = iter_column(args.raw, "corpus_train", "text")
            writer = ShardWriter(Path(tmp) / "train", args.seq_len + 1, 4096, tok.get_vocab_size())
            pack_corpus(ChatFormat(tok), batches, writer)

        pack_s = best_of(args.reps, pack)
    print(
        json.dumps(
            {
                "documents": len(texts),
                "tokens": n_tokens,
                "encode_batch_tokens_per_sec": n_tokens / raw_s,
                "pack_tokens_per_sec": n_tokens / pack_s,
                "pack_over_encode_batch": raw_s / pack_s,
            }
        )
    )


if __name__ == "__main__":
    main()
