"""tokenizer stage: train byte-level BPE on the training split of the raw corpus.

python stages/tokenizer.py --params params.yaml --raw data/raw --out data/tokenizer
"""

import argparse
from pathlib import Path

from stagelm.config import load_section, read_params, section_dict
from stagelm.errors import run_main
from stagelm.files import atomic_write_bytes
from stagelm.provenance import now, write_provenance
from stagelm.rawdata import read_raw
from stagelm.tokenizer import train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--raw", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    started = now()
    cfg = load_section(read_params(args.params), "tokenizer")

    texts = read_raw(args.raw, "corpus_train").column("text").to_pylist()
    tok = train_tokenizer(texts, cfg.vocab_size, cfg.min_frequency)
    atomic_write_bytes(args.out / "tokenizer.json", tok.to_str(pretty=True).encode())

    inputs = {"corpus_train": args.raw / "corpus_train.parquet"}
    write_provenance(args.out / "provenance.json", "tokenizer", {"tokenizer": section_dict(cfg)}, inputs, started)
    print(f"tokenizer: {tok.get_vocab_size()} tokens trained on {len(texts)} documents")


if __name__ == "__main__":
    run_main(main)
