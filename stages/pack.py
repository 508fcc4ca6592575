"""pack stage: tokenize the raw splits and pack them into Arrow shards of fixed-length rows.

python stages/pack.py --params params.yaml --raw data/raw --tokenizer data/tokenizer --out data/packed
"""

import argparse
from pathlib import Path

from stagelm.config import load_section, read_params, section_dict
from stagelm.errors import run_main
from stagelm.files import sha256_file
from stagelm.pack import pack_chats, pack_corpus, write_split
from stagelm.provenance import now, write_provenance
from stagelm.rawdata import read_raw
from stagelm.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--raw", required=True, type=Path)
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    started = now()
    cfg = load_section(read_params(args.params), "pack")
    tok_path = args.tokenizer / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    row_len = cfg.seq_len + 1  # seq_len inputs plus the last shifted target
    meta = {
        "tokenizer_sha256": sha256_file(tok_path),
        "vocab_size": tok.get_vocab_size(),
        "seq_len": cfg.seq_len,
    }

    for split in ("train", "val"):
        texts = read_raw(args.raw, f"corpus_{split}").column("text").to_pylist()
        columns, n_docs = pack_corpus(tok, texts, row_len)
        m = write_split(args.out / split, columns, cfg.rows_per_shard, {**meta, "documents": n_docs})
        print(f"pack: {split}: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")
    chats = read_raw(args.raw, "sft").column("messages").to_pylist()
    columns, n_docs = pack_chats(tok, chats, row_len)
    m = write_split(args.out / "sft", columns, cfg.rows_per_shard, {**meta, "documents": n_docs})
    print(f"pack: sft: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")

    inputs = {"raw": args.raw, "tokenizer": tok_path}
    write_provenance(args.out / "provenance.json", "pack", {"pack": section_dict(cfg)}, inputs, started)


if __name__ == "__main__":
    run_main(main)
