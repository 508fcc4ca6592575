"""pack stage: tokenize the raw splits and pack them into Arrow shards of fixed-length rows.

python stages/pack.py --params params.yaml --raw data/raw --tokenizer data/tokenizer --out data/packed

Under `stagelm launch` with N processes, process p packs the p-th of N contiguous
ranges of each corpus split's documents into its own shards (`shard-PPP-NNNNN.arrow`);
when all are done, process 0 writes each split's manifest, listing the shards in
process order. So the rows are the single process's, except that each process pads
its own last row. The SFT split is small and packed by process 0 alone.
"""

from pathlib import Path

from stagelm import distributed
from stagelm.config import load_section, section_dict
from stagelm.errors import run_main
from stagelm.files import read_json, sha256_file, write_json
from stagelm.pack import ShardWriter, pack_chats, pack_corpus, write_manifest, write_split
from stagelm.rawdata import iter_column, read_raw
from stagelm.stage import beside, start
from stagelm.tokenizer import load_tokenizer

SPLITS = ("train", "val", "sft")


def main() -> None:
    stage = start(__doc__, "raw", "tokenizer", "out")
    args = stage.args
    cfg = load_section(stage.params, "pack")
    index, count = distributed.join()
    for split in SPLITS:  # from here until each split's new manifest, no split looks packed
        (args.out / split / "manifest.json").unlink(missing_ok=True)
    tok_path = args.tokenizer / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    vocab, row_len = tok.get_vocab_size(), cfg.seq_len + 1  # seq_len inputs plus the last shifted target
    meta = {"tokenizer_sha256": sha256_file(tok_path), "vocab_size": vocab, "seq_len": cfg.seq_len}

    for split in ("train", "val"):  # streamed: documents in batches, shards written as they fill
        out = args.out / split
        texts = iter_column(args.raw, f"corpus_{split}", "text", share=(index, count))
        prefix = "shard-" if count == 1 else f"shard-{index:03d}-"
        part = pack_corpus(tok, texts, ShardWriter(out, row_len, cfg.rows_per_shard, vocab, prefix))
        parts = gather(out, part, index, count)
        if index == 0:
            m = write_manifest(out, row_len, vocab, parts, meta)
            print(f"pack: {split}: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")
    if index != 0:
        return
    chats = read_raw(args.raw, "sft").column("messages").to_pylist()
    columns, n_docs = pack_chats(tok, chats, row_len)
    m = write_split(args.out / "sft", columns, cfg.rows_per_shard, vocab, {**meta, "documents": n_docs})
    print(f"pack: sft: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")

    inputs = {"raw": args.raw, "tokenizer": tok_path}
    stage.record(beside(args.out), {"pack": section_dict(cfg)}, inputs, {"processes": count})


def gather(out: Path, part: dict, index: int, count: int) -> list[dict]:
    """Every process's part of a split, in process order, at process 0 (others get []):
    passed through `process-PPP.json` files in the split's folder, after a barrier."""
    if count == 1:
        return [part]
    write_json(out / f"process-{index:03d}.json", part)
    distributed.barrier(f"pack {out}")
    if index != 0:
        return []
    files = [out / f"process-{p:03d}.json" for p in range(count)]
    parts = [read_json(f) for f in files]
    for f in files:
        f.unlink()
    return parts


if __name__ == "__main__":
    run_main(main)
