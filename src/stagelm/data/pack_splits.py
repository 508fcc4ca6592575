"""The pack stage's three splits (train, val, sft), packed by one process or by many.

Under `stagelm launch` with N processes the output is the one process's, byte for byte:
process p encodes the p-th of N contiguous ranges of each corpus split's documents and
spills their tokens to the staging folder (2 bytes a token); once all are done, the
stream is cut into rows and shards exactly as one process cuts it, and process p writes
shards p, p + N, ...; process 0 writes the manifest and removes the spill. The SFT split
is small and packed by process 0 alone.
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from stagelm.data.chatformat import ChatFormat, load_chat_format
from stagelm.data.pack import (
    ShardWriter,
    pack_buffer_bytes,
    pack_chats,
    pack_corpus,
    segment_layout,
    write_manifest,
    write_split,
)
from stagelm.data.rawdata import iter_column, read_raw
from stagelm.data.shard_format import token_type
from stagelm.data.tokenizer import encode_joined, load_tokenizer
from stagelm.infra import distributed
from stagelm.infra.files import naming, read_json, sha256_file, write_json
from stagelm.infra.memory import host_available, require_memory


def spill_corpus(chat: ChatFormat, batches: Iterable[list[str]], folder: Path, name: str, dtype: np.dtype) -> None:
    """Encode (a share of) a corpus split streamed as batches of texts, appending its tokens
    (each document followed by EOS) to `folder/name.tokens` and each document's end (the
    offset one past its EOS) to `folder/name.ends`: raw arrays, read back by `Spilled`."""
    start = chat.bos if chat.add_bos else None
    end = 0
    with naming(folder), open(folder / f"{name}.tokens", "wb") as tokens, open(folder / f"{name}.ends", "wb") as ends:
        for texts in batches:
            joined, lengths = encode_joined(chat.tok, texts, chat.eos, start)
            joined.astype(dtype).tofile(tokens)
            (end + np.cumsum(lengths)).astype(np.int64).tofile(ends)
            end += int(lengths.sum())


class Spilled:
    """The token stream of a corpus split that `count` processes spilled in contiguous shares
    (`spill_corpus`, files `<prefix>PPP.tokens`/`.ends`), read as one stream in process order."""

    def __init__(self, folder: Path, prefix: str, count: int, dtype: np.dtype):
        def read(path: Path, kind: Any) -> np.ndarray:  # np.memmap cannot map an empty file
            return np.memmap(path, kind, "r") if path.stat().st_size else np.zeros(0, kind)

        self.tokens = [read(folder / f"{prefix}{p:03d}.tokens", dtype) for p in range(count)]
        self.ends = [read(folder / f"{prefix}{p:03d}.ends", np.int64) for p in range(count)]
        self.offsets = np.cumsum([0] + [len(t) for t in self.tokens])  # where each share starts in the stream
        self.first_docs = np.cumsum([0] + [len(e) for e in self.ends])
        self.total = int(self.offsets[-1])

    def rows(self, start: int, stop: int, row_len: int) -> dict[str, np.ndarray]:
        """Rows `start` to `stop` of concatenate-and-chunk over the whole stream (`pack_stream`'s
        rows): the last row of the stream is padded."""
        a, b = start * row_len, min(stop * row_len, self.total)
        tokens, docs = [], []
        for p, (t, e) in enumerate(zip(self.tokens, self.ends, strict=True)):
            lo, hi = max(a, self.offsets[p]) - self.offsets[p], min(b, self.offsets[p + 1]) - self.offsets[p]
            if lo < hi:
                tokens.append(np.asarray(t[lo:hi], np.int32))
                docs.append(self.first_docs[p] + np.searchsorted(e, np.arange(lo, hi), side="right"))
        padded = (stop - start) * row_len - (b - a)
        tokens.append(np.zeros(padded, np.int32))
        docs.append(np.full(padded, -1))
        segment_ids, positions = segment_layout(np.concatenate(docs).reshape(-1, row_len))
        rows = np.concatenate(tokens).reshape(-1, row_len)
        return {"tokens": rows, "segment_ids": segment_ids, "positions": positions}


def write_spilled(spilled: Spilled, writer: ShardWriter, index: int, count: int) -> dict[str, Any]:
    """Write shards number index, index + count, ... of the spilled stream (cut as one process
    cuts it: `rows_per_shard` rows each) with `writer`; return its part of the split. The
    documents are counted by the process whose share holds them."""
    rows = -(-spilled.total // writer.row_len)
    per = writer.rows_per_shard
    for number in range(index, -(-rows // per), count):
        start, stop = number * per, min((number + 1) * per, rows)
        writer.put(spilled.rows(start, stop, writer.row_len), number)
    return {**writer.close(), "documents": len(spilled.ends[index])}


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
