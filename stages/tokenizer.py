"""tokenizer stage: train byte-level BPE on the training split of the raw corpus.

python stages/tokenizer.py --params params.yaml --raw data/raw --out data/tokenizer

With `model.init_from` (hf:<folder> or gguf:<file>) it writes that checkpoint's own
tokenizer instead, unchanged (rebuilt from a GGUF's metadata), and its chat.json: its chat
template and the tokens that end a turn (stagelm.data.chatformat). The tokenizer section is then
unused; the checkpoint's files are hashed through data.inputs, a dependency of this stage.
"""

from stagelm.data.chatformat import write_chat_spec
from stagelm.data.rawdata import iter_column
from stagelm.data.tokenizer import CHAT_FILE, TrainingSample, train_tokenizer
from stagelm.infra.errors import run_main
from stagelm.infra.files import atomic_write_bytes
from stagelm.interop.checkpoint import checkpoint_source, read_checkpoint
from stagelm.pipeline.params import load_section, load_value, section_dict
from stagelm.pipeline.stage import beside, start


def main() -> None:
    stage = start(__doc__, "raw", "out")
    args = stage.args
    cfg = load_section(stage.params, "tokenizer")
    init_from = load_value(stage.params, "model.init_from")
    data_seed = load_value(stage.params, "data.seed")  # draws the sample when the split exceeds max_train_chars
    read = {"tokenizer": section_dict(cfg), "model.init_from": init_from, "data.seed": data_seed}

    chat = None
    if init_from is not None:
        source = checkpoint_source(init_from)
        checkpoint = read_checkpoint(source, weights=False)
        tok, chat = checkpoint.tokenizer, checkpoint.chat
        inputs = {"checkpoint": source}
        kind = "its chat template" if chat["template"] else "no chat template (text only)"
        done = f"{tok.get_vocab_size()} tokens of {source}, unchanged; {kind}"
    else:
        sample = TrainingSample(lambda: iter_column(args.raw, "corpus_train", "text"), cfg.max_train_chars, data_seed)
        tok = train_tokenizer(sample, cfg.vocab_size, cfg.min_frequency)
        inputs = {"corpus_train": args.raw / "corpus_train.parquet"}
        done = (
            f"{tok.get_vocab_size()} tokens trained on {sample.documents:,} of {sample.total_documents:,} "
            f"documents ({sample.chars:,} of {sample.total_chars:,} characters; tokenizer.max_train_chars "
            f"{cfg.max_train_chars:,})"
        )
    (args.out / CHAT_FILE).unlink(missing_ok=True)  # a previous checkpoint's, if any: stagelm's format has none
    text = checkpoint.tokenizer_json() if init_from is not None else tok.to_str(pretty=True).encode()
    atomic_write_bytes(args.out / "tokenizer.json", text)
    write_chat_spec(args.out, chat)
    stage.record(beside(args.out), read, inputs)
    print(f"tokenizer: {done}")


if __name__ == "__main__":
    run_main(main)
