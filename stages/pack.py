"""pack stage: tokenize the raw splits and pack them into Arrow shards of fixed-length rows.

python stages/pack.py --params params.yaml --raw data/raw --tokenizer data/tokenizer --out data/packed

Under `stagelm launch` with N processes the output is the one process's, byte for byte:
process p encodes the p-th of N contiguous ranges of each corpus split's documents and
spills their tokens to the staging folder (2 bytes a token); once all are done, the
stream is cut into rows and shards exactly as one process cuts it, and process p writes
shards p, p + N, ...; process 0 writes the manifest and removes the spill. The SFT split
is small and packed by process 0 alone.

Everything is written into a folder beside the output (`.packed.partial`), which
replaces the output only when all three splits are done: a failed or killed pack (a
full disk, a bad document) leaves the previous train, val and sft as they were.
"""

import shutil
from pathlib import Path
from typing import Any

from stagelm.data.chatformat import load_chat_format
from stagelm.data.pack import (
    ShardWriter,
    Spilled,
    pack_buffer_bytes,
    pack_chats,
    pack_corpus,
    spill_corpus,
    write_manifest,
    write_spilled,
    write_split,
)
from stagelm.data.rawdata import iter_column, read_raw
from stagelm.data.shard_format import token_type
from stagelm.data.tokenizer import load_tokenizer
from stagelm.infra import distributed
from stagelm.infra.errors import run_main
from stagelm.infra.files import read_json, replace_folder, sha256_file, write_json
from stagelm.infra.memory import host_available, require_memory
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import beside, start


def main() -> None:
    stage = start(__doc__, "raw", "tokenizer", "out")
    args = stage.args
    cfg = load_section(stage.params, "pack")
    index, count = distributed.join(load_section(stage.params, "launch").initialization_timeout)
    staging = args.out.with_name(f".{args.out.name}.partial")
    if index == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a killed run's leftovers
    distributed.barrier(f"pack {staging}")
    try:
        pack_splits(cfg, args.raw, args.tokenizer, staging, index, count)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if index != 0:
        return
    replace_folder(staging, args.out)
    inputs = {"raw": args.raw, "tokenizer": args.tokenizer / "tokenizer.json"}
    stage.record(beside(args.out), {"pack": section_dict(cfg)}, inputs, {"processes": count})


def pack_splits(cfg: Any, raw: Path, tokenizer: Path, out: Path, index: int, count: int) -> None:
    """Pack the train and val corpus (this process's share) and, at process 0, the SFT chats into `out`."""
    tok_path = tokenizer / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    chat = load_chat_format(tok, tokenizer)  # stagelm's format, or a checkpoint's template (its chat.json)
    vocab, row_len = tok.get_vocab_size(), cfg.seq_len + 1  # seq_len inputs plus the last shifted target
    what = f"a shard of pack.rows_per_shard {cfg.rows_per_shard} rows × {row_len} tokens"
    require_memory(pack_buffer_bytes(cfg.rows_per_shard, row_len), "pack.seq_len", what, have=host_available())
    meta = {"tokenizer_sha256": sha256_file(tok_path), "vocab_size": vocab, "seq_len": cfg.seq_len}

    for split in ("train", "val"):  # streamed: documents in batches, shards written as they fill
        texts = iter_column(raw, f"corpus_{split}", "text", share=(index, count))
        writer = ShardWriter(out / split, row_len, cfg.rows_per_shard, vocab)
        if count == 1:
            part = pack_corpus(chat, texts, writer)
        else:
            spill_corpus(chat, texts, out / split, f".spill-{index:03d}", token_type(vocab))
            distributed.barrier(f"pack {out / split} spilled")
            part = write_spilled(Spilled(out / split, ".spill-", count, token_type(vocab)), writer, index, count)
        parts = gather(out / split, part, index, count)
        if index == 0:
            m = write_manifest(out / split, row_len, vocab, parts, meta)
            print(f"pack: {split}: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")
    if index != 0:
        return
    chats = read_raw(raw, "sft").column("messages").to_pylist()
    columns, n_docs = pack_chats(chat, chats, row_len)
    m = write_split(out / "sft", columns, cfg.rows_per_shard, vocab, {**meta, "documents": n_docs})
    print(f"pack: sft: {m['rows']} rows, {m['tokens']} tokens, efficiency {m['packing_efficiency']:.3f}")


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
    for f in files + list(out.glob(".spill-*")):
        f.unlink()
    return parts


if __name__ == "__main__":
    run_main(main)
