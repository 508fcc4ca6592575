"""Packing loses no token, lays out segments and positions right, and masks SFT to assistant tokens."""

import numpy as np
import pytest
from conftest import micro_params, run_data_stages, tree_bytes, write_params

from stagelm.data.chatformat import ChatFormat
from stagelm.data.loader import PackedRows
from stagelm.data.pack import (
    CorpusPacker,
    ShardWriter,
    pack_chats,
    pack_corpus,
    pack_next_fit,
    pack_stream,
    write_manifest,
    write_split,
)
from stagelm.data.pack_splits import Spilled, spill_corpus, write_spilled
from stagelm.data.rawdata import iter_column, read_raw
from stagelm.data.tokenizer import EOS, encode_batch, encode_joined, load_tokenizer, special_id
from stagelm.infra.files import read_json

EOS_ID = 2  # <|eos|> in a tokenizer the tokenizer stage trains


def docs_of(lengths, start=10):
    rng = np.random.default_rng(0)
    return [rng.integers(start, 200, n).astype(np.int32) for n in lengths]


def non_pad(columns):
    return columns["tokens"][columns["segment_ids"] > 0]


@pytest.mark.parametrize("lengths", [[3, 5, 40, 1, 17], [8], [9], [100, 2, 2, 2]])
def test_stream_packing_loses_no_token(lengths):
    docs = docs_of(lengths)
    cols = pack_stream(docs, 9, EOS_ID)
    expected = np.concatenate([np.append(d, EOS_ID) for d in docs])
    np.testing.assert_array_equal(non_pad(cols), expected)
    assert cols["tokens"].shape[1] == 9


def test_segments_and_positions_restart_per_document():
    cols = pack_stream(docs_of([3, 2, 6]), 8, EOS_ID)  # 4 + 3 + 7 = 14 tokens → 2 rows
    np.testing.assert_array_equal(cols["segment_ids"], [[1, 1, 1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(cols["positions"], [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 0]])
    assert (cols["tokens"][1, 6:] == 0).all()


def test_next_fit_keeps_documents_whole_and_masks():
    docs = docs_of([3, 4, 2, 12])
    masks = [np.array([0, 1, 1]), np.array([0, 0, 1, 1]), np.array([1, 1]), np.ones(12, int)]
    cols = pack_next_fit(docs, masks, 6, EOS_ID)
    np.testing.assert_array_equal(non_pad(cols), np.concatenate([np.append(d, EOS_ID) for d in docs]))
    # rows: [doc0+eos, pad..], [doc1+eos, pad], [doc2+eos, ...]: no document is cut unless longer than a row
    np.testing.assert_array_equal(cols["segment_ids"][0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(cols["loss_mask"][0], [0, 1, 1, 0, 0, 0])  # the EOS is not trained on
    assert cols["segment_ids"].max() <= 2


def test_packed_shards_hold_exactly_the_documents(micro_data):
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    for split in ("train", "val"):
        rows = PackedRows(micro_data / "packed" / split)
        texts = read_raw(micro_data / "raw", f"corpus_{split}").column("text").to_pylist()
        eos = special_id(tok, EOS)
        expected = np.concatenate([np.append(d, eos) for d in encode_batch(tok, texts)])
        cols = rows.all_rows()
        np.testing.assert_array_equal(non_pad(cols), expected)
        manifest = rows.manifest
        assert manifest["tokens"] == len(expected) and manifest["documents"] == len(texts)
        assert manifest["row_len"] == manifest["seq_len"] + 1 == 65
        assert len(manifest["shards"]) > 1 and manifest["vocab_size"] == tok.get_vocab_size()
        assert 0.99 < manifest["packing_efficiency"] <= 1
        assert 0 < manifest["unigram_entropy_nats"] < np.log(tok.get_vocab_size())
        assert manifest["token_dtype"] == "uint16"


def test_sft_rows_train_only_on_assistant_turns(micro_data):
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    cols = PackedRows(micro_data / "packed/sft").all_rows()
    trained = tok.decode(cols["tokens"][cols["loss_mask"] == 1].tolist(), skip_special_tokens=False)
    chats = read_raw(micro_data / "raw", "sft").column("messages").to_pylist()
    assert trained == "".join(m[1]["content"] + "<|end|>" for m in chats)
    assert read_json(micro_data / "packed/sft/manifest.json")["documents"] == len(chats)


def test_shards_cost_at_most_the_promised_bytes_per_token(micro_data, tmp_path):
    """Issue 16's budget: ≤ 2.5 bytes a token in corpus shards, ≤ 3.5 in SFT shards (the
    micro pipeline's 32-row shards are mostly Arrow headers, so this packs 1,024-row ones)."""
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    vocab = tok.get_vocab_size()
    corpus = ShardWriter(tmp_path / "train", 257, 1024, vocab)
    part = pack_corpus(ChatFormat(tok), iter_column(micro_data / "raw", "corpus_train", "text"), corpus)
    train = write_manifest(tmp_path / "train", 257, vocab, [part], {})
    chats = read_raw(micro_data / "raw", "sft").column("messages").to_pylist()
    sft = write_split(tmp_path / "sft", pack_chats(ChatFormat(tok), chats, 257)[0], 1024, vocab, {})
    for name, manifest, budget in (("train", train, 2.5), ("sft", sft, 3.5)):
        size = sum((tmp_path / name / s["file"]).stat().st_size for s in manifest["shards"])
        assert size / manifest["tokens"] <= budget, name


@pytest.mark.parametrize(("vocab_size", "row_len"), [(300, 9), (70_000, 9), (300, 70_000)])
def test_shards_read_back_exactly_the_packed_rows(tmp_path, vocab_size, row_len):
    """The compact format (narrow tokens, derived segments and positions, mask bits) loses nothing."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, vocab_size, n).astype(np.int32) for n in [3, 5, 40, 1, 17, 9, 9, 2, 30, 8, 6, 6, 9000]]
    masks = [rng.integers(0, 2, len(d)) for d in docs]
    for name, columns in [
        ("stream", pack_stream(docs, row_len, EOS_ID)),
        ("next_fit", pack_next_fit(docs, masks, row_len, EOS_ID)),
    ]:
        write_split(tmp_path / name, columns, 4, vocab_size, {})
        rows = PackedRows(tmp_path / name)
        got = rows.all_rows()
        assert got.keys() == columns.keys()
        for key in columns:
            assert got[key].dtype == np.int32
            np.testing.assert_array_equal(got[key], columns[key], err_msg=f"{name} {key}")
        assert rows.manifest["token_dtype"] == ("uint16" if vocab_size <= 65536 else "uint32")


@pytest.mark.parametrize("batch", [1, 2, 7, 100])
def test_streamed_packing_writes_exactly_the_in_memory_shards(tmp_path, batch):
    docs = docs_of([3, 5, 40, 1, 17, 9, 9, 2, 30, 8, 6, 6])
    whole = write_split(tmp_path / "whole", pack_stream(docs, 9, EOS_ID), 4, 300, {"documents": len(docs)})
    packer = CorpusPacker(ShardWriter(tmp_path / f"streamed{batch}", 9, 4, 300), EOS_ID)
    for start in range(0, len(docs), batch):
        packer.add(docs[start : start + batch])
        assert len(packer.tail) < 9 and packer.writer.pending_rows < 4  # only the unfinished row and shard wait
    assert packer.finish({}) == whole  # rows, tokens, entropy and every shard's sha256


@pytest.mark.parametrize(("count", "rows_per_shard"), [(2, 1000), (3, 4), (5, 3)])
def test_shares_spilled_by_several_processes_give_the_one_process_shards(micro_data, tmp_path, count, rows_per_shard):
    """What N processes of the pack stage do, played in one process: every process spills its
    share, then writes shards p, p + N, ... of the joined stream (one shard: the others write
    none; more processes than shards, too)."""
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    vocab, dtype, raw = tok.get_vocab_size(), np.dtype(np.uint16), micro_data / "raw"
    one = tmp_path / "one"
    part = pack_corpus(
        ChatFormat(tok), iter_column(raw, "corpus_val", "text"), ShardWriter(one, 65, rows_per_shard, vocab)
    )
    write_manifest(one, 65, vocab, [part], {})
    many = tmp_path / "many"
    writers = [ShardWriter(many, 65, rows_per_shard, vocab) for _ in range(count)]
    for p in range(count):
        spill_corpus(
            ChatFormat(tok), iter_column(raw, "corpus_val", "text", share=(p, count)), many, f".spill-{p:03d}", dtype
        )
    spilled = Spilled(many, ".spill-", count, dtype)
    parts = [write_spilled(spilled, writers[p], p, count) for p in range(count)]
    for spill in many.glob(".spill-*"):
        spill.unlink()
    write_manifest(many, 65, vocab, parts, {})
    assert tree_bytes(many) == tree_bytes(one)
    assert read_json(one / "manifest.json")["documents"] == len(read_raw(raw, "corpus_val"))


@pytest.mark.slow
def test_data_stages_rerun_to_identical_bytes(micro_data, tmp_path):
    """Issue 17: the same code, params and inputs give byte-identical data folders (so DVC
    sees a forced rerun as no change); times and the commit sit beside them, not inside."""
    write_params(tmp_path / "params.yaml", micro_params())
    again = run_data_stages(tmp_path)
    for name in ("raw", "tokenizer", "packed"):
        first, second = tree_bytes(micro_data / name), tree_bytes(again / name)
        assert first.keys() == second.keys() and first == second, name
        assert not any(path.endswith("provenance.json") for path in first), name
        assert (again / f"{name}.provenance.json").is_file()


def test_a_long_document_and_a_spelled_eos_stay_one_document_each(micro_data, tmp_path):
    tok = load_tokenizer(micro_data / "tokenizer/tokenizer.json")
    long = " ".join(f"Tom had {i} red apples." for i in range(12_000))  # ~260 K characters: encoded in pieces
    spelled = "a document that writes <|eos|> in the middle"  # text, not the token (load_tokenizer)
    packer = CorpusPacker(ShardWriter(tmp_path / "out", 65, 1024, tok.get_vocab_size()), EOS_ID)
    packer.add_joined(*encode_joined(tok, [long, spelled], EOS_ID))
    assert packer.finish({})["documents"] == 2
    rows = PackedRows(tmp_path / "out").all_rows()
    stream = rows["tokens"][rows["segment_ids"] > 0].tolist()
    expected = [*tok.encode(long, add_special_tokens=False).ids, EOS_ID, *tok.encode(spelled).ids, EOS_ID]
    assert stream == expected  # the long one's pieces joined with no <|eos|> between, ids as if whole
