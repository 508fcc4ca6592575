"""tokenizer stage: train byte-level BPE on the training split of the raw corpus.

python stages/tokenizer.py --params params.yaml --raw data/raw --out data/tokenizer

With `model.init_from: hf:<dir>` it adopts that checkpoint's tokenizer.json instead
(the tokenizer section is then unused), appending the chat specials it lacks.
"""

import argparse
from pathlib import Path

from stagelm.config import init_dir, load_section, load_value, read_params, section_dict
from stagelm.errors import run_main
from stagelm.files import atomic_write_bytes
from stagelm.provenance import now, write_provenance
from stagelm.rawdata import read_raw
from stagelm.tokenizer import adopt_tokenizer, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--raw", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    started = now()
    params = read_params(args.params)
    cfg = load_section(params, "tokenizer")
    init_from = load_value(params, "model.init_from")
    read = {"tokenizer": section_dict(cfg), "model.init_from": init_from}

    if init_from is not None:
        source = init_dir(init_from) / "tokenizer.json"
        tok, added = adopt_tokenizer(source)
        inputs = {"tokenizer": source}
        done = f"{tok.get_vocab_size()} tokens adopted from {source}; appended: {', '.join(added) or 'none'}"
    else:
        texts = read_raw(args.raw, "corpus_train").column("text").to_pylist()
        tok = train_tokenizer(texts, cfg.vocab_size, cfg.min_frequency)
        inputs = {"corpus_train": args.raw / "corpus_train.parquet"}
        done = f"{tok.get_vocab_size()} tokens trained on {len(texts)} documents"
    atomic_write_bytes(args.out / "tokenizer.json", tok.to_str(pretty=True).encode())
    write_provenance(args.out / "provenance.json", "tokenizer", read, inputs, started)
    print(f"tokenizer: {done}")


if __name__ == "__main__":
    run_main(main)
