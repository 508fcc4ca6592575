"""Corpus sources (synthetic, local files, local datasets, the hub) and their errors."""

import bz2
import dataclasses
import gzip
import json
import os
import socket
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, make_project, micro_params, run, write_params

from stagelm.data import corpus_files, download, hub
from stagelm.infra.errors import StagelmError
from stagelm.infra.files import read_json
from stagelm.pipeline.params import load_section


def data_cfg(**overrides):
    return dataclasses.replace(load_section(micro_params(), "data"), **overrides)


def collect(cfg, out):
    """(train docs, val docs, manifest) of a download into `out`, read back from its Parquet files."""
    manifest, _ = download.write_download(cfg, out)
    train, val = (pq.read_table(out / f"corpus_{s}.parquet").column("text").to_pylist() for s in ("train", "val"))
    return train, val, manifest


def write_docs(tmp_path, kind, texts, field="text"):
    """`texts` as one corpus file of `kind` (a suffix such as "jsonl.gz"); returns its path."""
    base, _, compression = kind.partition(".")
    path = tmp_path / f"corpus.{kind}"
    if base == "txt":
        data = ("\n\n".join(texts) + "\n").encode()
    elif base == "jsonl":
        data = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    elif base == "json":
        data = json.dumps([{field: t, "id": i} for i, t in enumerate(texts)], indent=1).encode()
    elif base == "csv":
        data = (f"{field},id\n" + "".join(f'"{t}",{i}\n' for i, t in enumerate(texts))).encode()
    else:
        pq.write_table(pa.table({field: texts}), path)
        return path
    if compression == "gz":
        data = gzip.compress(data)
    elif compression == "bz2":
        data = bz2.compress(data)
    elif compression == "zst":
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write(data)
        data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return path


TEXTS = [f"Document number {i} says hello to the world." for i in range(200)]
KINDS = ["txt", "txt.bz2", "jsonl", "jsonl.gz", "jsonl.zst", "json", "csv", "csv.gz", "parquet"]


@pytest.mark.parametrize("kind", KINDS)
def test_local_files(tmp_path, kind):
    path = write_docs(tmp_path, kind, TEXTS)
    train, val, meta = collect(data_cfg(source=f"files:{path}"), tmp_path / "raw")
    assert sorted(train + val) == sorted(TEXTS) and not set(train) & set(val)
    assert 5 <= len(val) <= 40  # val_fraction 0.1 of 200, by hash
    assert meta["source"] == f"files:{path}" and meta["task_sets"]["sft"].startswith("synthetic")
    assert meta["corpus_characters"]["train"] == sum(map(len, train))


def test_text_paragraphs_across_read_chunks(tmp_path, monkeypatch):
    """Blank lines, CRLF line ends and multi-byte characters that straddle read chunks."""
    texts = [f"Ünïcode paragraph {i}\r\nwith a second line ✓" for i in range(50)]
    path = tmp_path / "crlf.txt"
    path.write_bytes(("\r\n\r\n".join(texts) + "\r\n\r\n\r\n").encode())
    whole = collect(data_cfg(source=f"files:{path}"), tmp_path / "a")
    monkeypatch.setattr(corpus_files, "READ_CHUNK", 3)
    assert collect(data_cfg(source=f"files:{path}"), tmp_path / "b") == whole
    assert sorted(whole[0] + whole[1]) == sorted(t.replace("\r\n", "\n") for t in texts)


def test_glob_directory_and_document_cap(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"part{i}.jsonl").write_text("".join(json.dumps({"body": f"{i}-{j}"}) + "\n" for j in range(50)))
    train, val, _ = collect(data_cfg(source=f"files:{corpus}/*.jsonl", text_field="body"), tmp_path / "a")
    assert len(train + val) == 150
    collect(data_cfg(source=f"files:{corpus}/*.jsonl", text_field="body"), tmp_path / "again")
    for name in ("corpus_train.parquet", "corpus_val.parquet", "manifest.json"):  # byte-identical reruns
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    train, val, _ = collect(data_cfg(source=f"files:{corpus}", text_field="body", max_documents=70), tmp_path / "b")
    assert sorted(train + val) == sorted([f"0-{j}" for j in range(50)] + [f"1-{j}" for j in range(20)])


def test_local_hf_dataset_directory(tmp_path):
    ds_dir = tmp_path / "my_dataset"
    (ds_dir / "data").mkdir(parents=True)
    pq.write_table(pa.table({"content": TEXTS}), ds_dir / "data/train-00000-of-00001.parquet")
    cfg = data_cfg(source=f"hf:{ds_dir}", text_field="content", hf_split="train")
    train, val, meta = collect(cfg, tmp_path / "raw")
    assert sorted(train + val) == sorted(TEXTS)
    assert meta["source"].startswith(f"hf:{ds_dir}")
    # The same documents from files split the same way: the split is by content.
    assert collect(data_cfg(source=f"files:{ds_dir}/data", text_field="content"), tmp_path / "files")[:2] == (
        train,
        val,
    )


def test_val_split_is_by_content_and_stable_when_files_are_added(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("\n\n".join(TEXTS[:100]))
    train, val, _ = collect(data_cfg(source=f"files:{corpus}"), tmp_path / "one")
    # A file added before the old one in reading order, and the old file's documents reversed.
    (corpus / "a.txt").write_text("\n\n".join(TEXTS[100:]))
    (corpus / "b.txt").write_text("\n\n".join(reversed(TEXTS[:100])))
    train2, val2, _ = collect(data_cfg(source=f"files:{corpus}"), tmp_path / "two")
    assert set(train) <= set(train2) and set(val) <= set(val2)
    assert train2[: len(TEXTS) - 100 - (len(val2) - len(val))] == [t for t in TEXTS[100:] if t in set(train2)]
    other = collect(data_cfg(source=f"files:{corpus}", seed=1), tmp_path / "seed1")
    assert set(other[1]) != set(val2)


def test_synthetic_split_is_deterministic_and_by_document():
    docs = [f"d{i}" for i in range(100)]
    a = download.split_documents(docs, 0.1, 5)
    assert a == download.split_documents(docs, 0.1, 5) and len(a[1]) == 10
    assert a != download.split_documents(docs, 0.1, 6)


def test_task_files_replace_synthetic_sets(tmp_path):
    sft = tmp_path / "sft.jsonl.gz"
    message = {
        "family": "arithmetic",
        "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2."}],
    }
    sft.write_bytes(gzip.compress((json.dumps(message) + "\n").encode()))
    _, _, meta = collect(data_cfg(sft_files=str(sft)), tmp_path / "raw")
    assert meta["files"]["sft"]["rows"] == 1 and meta["task_sets"]["sft"] == f"files:{sft}"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"family": "poetry", "prompt": "x", "chat_prompt": "y", "spec": {}}))
    with pytest.raises(StagelmError, match=r"bad\.jsonl:1: family: unknown 'poetry'"):
        collect(data_cfg(eval_files=str(tmp_path / "bad.jsonl")), tmp_path / "raw2")


def test_bad_sources_fail_with_one_named_line(tmp_path):
    cases = []
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    cases.append((data_cfg(source=f"files:{empty}"), r"^data\.source: .* holds no non-empty documents"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    cases.append((data_cfg(source=f"files:{latin}"), rf"^{latin}: not UTF-8 text \(byte 3\)"))
    jsonl = write_docs(tmp_path, "jsonl", TEXTS, field="body")
    cases.append((data_cfg(source=f"files:{jsonl}"), r"^data\.text_field: .*corpus\.jsonl:1 has no column 'text'"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    cases.append((data_cfg(source=f"files:{broken}"), rf"^{broken}:2: not a JSON object"))
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    cases.append((data_cfg(source=f"files:{one}"), r"^data\.val_fraction: 0\.1 of 1 document\(s\) left the"))
    cases.append((data_cfg(source=f"files:{tmp_path}/nothing*.txt"), r"^data\.source: .* matches no"))
    cases.append((data_cfg(source="s3://bucket/corpus"), r"^data\.source: unknown source"))
    missing = r"^data\.source: hf:someone/some-dataset: no such local dataset folder; .* or pin a hub dataset"
    cases.append((data_cfg(source="hf:someone/some-dataset", hf_revision=None), missing))
    for i, (cfg, pattern) in enumerate(cases):
        with pytest.raises(StagelmError, match=pattern):
            collect(cfg, tmp_path / f"raw{i}")
        assert not list((tmp_path / f"raw{i}").glob("*")), "a failed download leaves files behind"


def test_corrupt_or_vanishing_file_keeps_the_old_download(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    first = write_docs(corpus, "jsonl.gz", TEXTS)
    second = corpus / "more.jsonl.gz"
    second.write_bytes(first.read_bytes())
    out = tmp_path / "raw"
    collect(data_cfg(source=f"files:{corpus}"), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    second.write_bytes(first.read_bytes()[:-40])  # a truncated download
    with pytest.raises(StagelmError, match=rf"^{second}: cannot be read as json: .*; fix or remove the file$"):
        collect(data_cfg(source=f"files:{corpus}"), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    real = corpus_files.read_json_rows

    def read_then_lose_the_next(path, field):  # the second file disappears while the first is read
        yield from real(path, field)
        second.unlink(missing_ok=True)

    monkeypatch.setattr(corpus_files, "read_json_rows", read_then_lose_the_next)
    with pytest.raises(StagelmError, match=rf"^{second}: vanished while the corpus was being read"):
        collect(data_cfg(source=f"files:{corpus}"), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_unreachable_hub_fails_fast(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    t0 = time.perf_counter()
    with pytest.raises(StagelmError, match=r"^data\.source: the Hugging Face hub is unreachable"):
        collect(data_cfg(source="hf:someone/some-dataset", hf_revision="main"), tmp_path / "raw")
    assert time.perf_counter() - t0 < 5


def test_hub_probe_really_times_out_here():
    t0 = time.perf_counter()
    hub.hub_reachable(timeout=2.0)
    assert time.perf_counter() - t0 < 4


@pytest.mark.parametrize("source", ["missing", "corrupt"])
def test_stage_exits_nonzero_with_one_line(tmp_path, source):
    corrupt = tmp_path / "corpus.jsonl.gz"
    corrupt.write_bytes(gzip.compress(b'{"text": "a document"}\n' * 5000)[:-100])
    pattern = {"missing": "does/not/exist/*.txt", "corrupt": str(corrupt)}[source]
    params = micro_params(data={"source": f"files:{pattern}", "inputs": str(tmp_path)})
    write_params(tmp_path / "params.yaml", params)
    result = run(
        [sys.executable, str(ROOT / "stages/download.py"), "--params", "params.yaml", "--out", "raw"],
        tmp_path,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(
        "error: data.source:" if source == "missing" else f"error: {corrupt}: cannot be read"
    )
    assert not (tmp_path / "raw").exists()  # no manifest, no partial files, not even the folder


# --- what a file holds besides documents: byte order marks, NUL, hidden folders, bad CSV ----


@pytest.mark.parametrize("kind", ["txt", "jsonl", "csv"])
def test_a_byte_order_mark_is_not_text(tmp_path, kind):
    path = write_docs(tmp_path, kind, TEXTS)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # as Windows editors save UTF-8
    train, val, _ = collect(data_cfg(source=f"files:{path}"), tmp_path / "raw")
    assert sorted(train + val) == sorted(TEXTS)  # no U+FEFF before the first document


def test_nul_bytes_are_refused_naming_file_and_offset(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"a first document\n\nsecond \x00 one\n")
    with pytest.raises(StagelmError, match=rf"^{text}: a NUL byte at byte 25; .* re-encode or remove the file$"):
        collect(data_cfg(source=f"files:{text}"), tmp_path / "raw")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "bad\u0000doc"}) + "\n")
    with pytest.raises(StagelmError, match=rf"^{rows}: document 2 holds a NUL character \(offset 3\)"):
        collect(data_cfg(source=f"files:{rows}"), tmp_path / "raw")
    assert not (tmp_path / "raw").exists()


def test_hidden_folders_inside_a_corpus_folder_are_not_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    write_docs(corpus if corpus.mkdir() is None else corpus, "jsonl", TEXTS)
    (corpus / ".ipynb_checkpoints").mkdir()
    (corpus / ".ipynb_checkpoints/corpus-checkpoint.jsonl").write_bytes((corpus / "corpus.jsonl").read_bytes())
    (corpus / ".hidden.jsonl").write_bytes((corpus / "corpus.jsonl").read_bytes())
    for source in (f"files:{corpus}", f"files:{corpus}/**/*.jsonl"):
        train, val, _ = collect(data_cfg(source=source), tmp_path / "raw")
        assert len(train + val) == len(TEXTS)  # not doubled


def test_a_csv_quote_left_open_names_the_file_and_line(tmp_path):
    path = tmp_path / "corpus.csv"
    rows = [f'"{t}",{i}' for i, t in enumerate(TEXTS[:50])]
    rows[20] = '"an unterminated quote,20'
    path.write_text("text,id\n" + "\n".join(rows) + "\n")
    with pytest.raises(StagelmError, match=rf"^{path}:22: .*a quote left open\?\); fix the row$"):
        collect(data_cfg(source=f"files:{path}"), tmp_path / "raw")
    single = tmp_path / "single.csv"  # one column: the open quote would swallow the rest of the file
    single.write_text("text\n" + "\n".join(f'"{t}"' for t in TEXTS[:30]) + '\n"open\n' + "\n".join(TEXTS[30:60]))
    with pytest.raises(StagelmError, match=rf"^{single}:32: not valid CSV"):
        collect(data_cfg(source=f"files:{single}"), tmp_path / "raw")
    multi = tmp_path / "multi.csv"  # a quoted value may hold line breaks: a paragraph is one document
    multi.write_text('text,id\n"line one\nline two",0\n"plain",1\n' + "".join(f'"d{i}",{i}\n' for i in range(40)))
    train, val, _ = collect(data_cfg(source=f"files:{multi}"), tmp_path / "raw")
    assert "line one\nline two" in train + val and len(train + val) == 42


def test_written_files_are_readable_by_others_as_open_makes_them(tmp_path):
    os.umask(old := os.umask(0o022))
    out = tmp_path / "raw"
    collect(data_cfg(), out)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~old), modes  # manifest.json included (atomic_write_bytes)


def dvc_status(project) -> dict:
    return json.loads(run(["dvc", "status", "--json"], project).stdout or "{}")


@pytest.mark.slow
def test_an_edited_corpus_file_reruns_download_and_an_untouched_one_does_not(tmp_path):
    """The real `dvc` on a copy of the project: data.inputs is a dependency DVC hashes."""
    project = make_project(tmp_path / "stagelm", micro_params())
    corpus = project / "inputs/corpus"
    corpus.mkdir()
    for part in range(2):
        lines = [json.dumps({"text": f"Story {part}-{i}: Mia found a red lamp in the garden."}) for i in range(60)]
        (corpus / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    (corpus / ".ipynb_checkpoints").mkdir()  # not corpus: neither read nor hashed (.dvcignore)
    write_params(project / "params.yaml", micro_params(data={"source": "files:inputs/corpus/*.jsonl"}))
    run(["dvc", "repro", "download"], project)  # the params check, then download
    assert not {"params", "download"} & set(dvc_status(project))
    (corpus / ".ipynb_checkpoints/part0-checkpoint.jsonl").write_text((corpus / "part0.jsonl").read_text())
    assert "download" not in dvc_status(project)  # a notebook's autosave is not an edit of the corpus
    with (corpus / "part1.jsonl").open("a") as f:
        f.write(json.dumps({"text": "One more story, added by hand."}) + "\n")
    assert "download" in dvc_status(project)  # DVC hashes the files, not only the params string
    out = run(["dvc", "repro", "-s", "download"], project).stdout
    assert "Running stage 'download'" in out
    documents = read_json(project / "data/raw/manifest.json")["documents"]
    assert documents["train"] + documents["val"] == 121
    assert "download" not in dvc_status(project)
