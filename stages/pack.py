"""pack stage: tokenize the raw splits and pack them into Arrow shards of fixed-length rows.

python stages/pack.py --params params.yaml --raw data/raw --tokenizer data/tokenizer --out data/packed
"""

from stagelm.config import load_section, section_dict
from stagelm.errors import run_main
from stagelm.files import sha256_file
from stagelm.pack import ShardWriter, pack_chats, pack_corpus, write_split
from stagelm.rawdata import iter_column, read_raw
from stagelm.stage import start
from stagelm.tokenizer import load_tokenizer


def main() -> None:
    stage = start(__doc__, "raw", "tokenizer", "out")
    args = stage.args
    cfg = load_section(stage.params, "pack")
    tok_path = args.tokenizer / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    row_len = cfg.seq_len + 1  # seq_len inputs plus the last shifted target
    meta = {
        "tokenizer_sha256": sha256_file(tok_path),
        "vocab_size": tok.get_vocab_size(),
        "seq_len": cfg.seq_len,
    }

    for split in ("train", "val"):  # streamed: documents in batches, shards written as they fill
        texts = iter_column(args.raw, f"corpus_{split}", "text")
        m = pack_corpus(tok, texts, ShardWriter(args.out / split, row_len, cfg.rows_per_shard), meta)
        print(f"pack: {split}: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")
    chats = read_raw(args.raw, "sft").column("messages").to_pylist()
    columns, n_docs = pack_chats(tok, chats, row_len)
    m = write_split(args.out / "sft", columns, cfg.rows_per_shard, {**meta, "documents": n_docs})
    print(f"pack: sft: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")

    inputs = {"raw": args.raw, "tokenizer": tok_path}
    stage.record(args.out / "provenance.json", {"pack": section_dict(cfg)}, inputs)


if __name__ == "__main__":
    run_main(main)
