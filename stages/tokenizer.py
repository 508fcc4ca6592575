"""tokenizer stage: train byte-level BPE on the training split of the raw corpus.

python stages/tokenizer.py --params params.yaml --raw data/raw --out data/tokenizer

With `model.init_from: hf:<dir>` it adopts that checkpoint's tokenizer.json instead
(the tokenizer section is then unused), appending the chat specials it lacks.
"""

from stagelm.config import init_dir, load_section, load_value, section_dict
from stagelm.errors import run_main
from stagelm.files import atomic_write_bytes
from stagelm.rawdata import iter_column
from stagelm.stage import beside, start
from stagelm.tokenizer import TrainingSample, adopt_tokenizer, train_tokenizer


def main() -> None:
    stage = start(__doc__, "raw", "out")
    args = stage.args
    cfg = load_section(stage.params, "tokenizer")
    init_from = load_value(stage.params, "model.init_from")
    data_seed = load_value(stage.params, "data.seed")  # draws the sample when the split exceeds max_train_chars
    read = {"tokenizer": section_dict(cfg), "model.init_from": init_from, "data.seed": data_seed}

    if init_from is not None:
        source = init_dir(init_from) / "tokenizer.json"
        tok, added = adopt_tokenizer(source)
        inputs = {"tokenizer": source}
        done = f"{tok.get_vocab_size()} tokens adopted from {source}; appended: {', '.join(added) or 'none'}"
    else:
        sample = TrainingSample(lambda: iter_column(args.raw, "corpus_train", "text"), cfg.max_train_chars, data_seed)
        tok = train_tokenizer(sample, cfg.vocab_size, cfg.min_frequency)
        inputs = {"corpus_train": args.raw / "corpus_train.parquet"}
        done = (
            f"{tok.get_vocab_size()} tokens trained on {sample.documents:,} of {sample.total_documents:,} "
            f"documents ({sample.chars:,} of {sample.total_chars:,} characters; tokenizer.max_train_chars "
            f"{cfg.max_train_chars:,})"
        )
    atomic_write_bytes(args.out / "tokenizer.json", tok.to_str(pretty=True).encode())
    stage.record(beside(args.out), read, inputs)
    print(f"tokenizer: {done}")


if __name__ == "__main__":
    run_main(main)
