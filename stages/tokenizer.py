"""tokenizer stage: train byte-level BPE on the training split of the raw corpus.

python stages/tokenizer.py --params params.yaml --raw data/raw --out data/tokenizer

With `model.init_from: hf:<dir>` it adopts that checkpoint's tokenizer.json instead
(the tokenizer section is then unused), appending the chat specials it lacks.
"""

from stagelm.config import init_dir, load_section, load_value, section_dict
from stagelm.errors import run_main
from stagelm.files import atomic_write_bytes
from stagelm.rawdata import read_raw
from stagelm.stage import start
from stagelm.tokenizer import adopt_tokenizer, train_tokenizer


def main() -> None:
    stage = start(__doc__, "raw", "out")
    args = stage.args
    cfg = load_section(stage.params, "tokenizer")
    init_from = load_value(stage.params, "model.init_from")
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
    stage.record(args.out / "provenance.json", read, inputs)
    print(f"tokenizer: {done}")


if __name__ == "__main__":
    run_main(main)
