"""Corpus sources (synthetic, local files, local datasets, the hub) and their errors."""

import dataclasses
import json
import socket
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, micro_params, run, write_params

from stagelm import download
from stagelm.config import load_section
from stagelm.errors import StagelmError


def data_cfg(**overrides):
    return dataclasses.replace(load_section(micro_params(), "data"), **overrides)


def write_docs(tmp_path, kind, texts, field="text"):
    path = tmp_path / f"corpus.{kind}"
    if kind == "txt":
        path.write_text("\n\n".join(texts) + "\n")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    elif kind == "parquet":
        pq.write_table(pa.table({field: texts}), path)
    elif kind == "csv":
        path.write_text(f"{field},id\n" + "".join(f'"{t}",{i}\n' for i, t in enumerate(texts)))
    return path


TEXTS = [f"Document number {i} says hello to the world." for i in range(30)]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "csv"])
def test_local_files(tmp_path, kind):
    path = write_docs(tmp_path, kind, TEXTS)
    train, val, sets, meta = download.collect(data_cfg(source=f"files:{path}"))
    assert sorted(train + val) == sorted(TEXTS) and not set(train) & set(val)
    assert meta["source"] == f"files:{path}" and meta["task_sets"]["sft"].startswith("synthetic")


def test_glob_directory_and_document_cap(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.jsonl").write_text("".join(json.dumps({"body": f"{i}-{j}"}) + "\n" for j in range(5)))
    train, val, _, _ = download.collect(data_cfg(source=f"files:{tmp_path}/*.jsonl", text_field="body"))
    assert len(train + val) == 15
    train, val, _, _ = download.collect(data_cfg(source=f"files:{tmp_path}", text_field="body", max_documents=7))
    assert len(train + val) == 7


def test_local_hf_dataset_directory(tmp_path):
    ds_dir = tmp_path / "my_dataset"
    (ds_dir / "data").mkdir(parents=True)
    pq.write_table(pa.table({"content": TEXTS}), ds_dir / "data/train-00000-of-00001.parquet")
    train, val, _, meta = download.collect(data_cfg(source=f"hf:{ds_dir}", text_field="content", hf_split="train"))
    assert sorted(train + val) == sorted(TEXTS)
    assert meta["source"].startswith(f"hf:{ds_dir}")


def test_split_is_deterministic_and_by_document():
    docs = [f"d{i}" for i in range(100)]
    a = download.split_documents(docs, 0.1, 5)
    assert a == download.split_documents(docs, 0.1, 5) and len(a[1]) == 10
    assert a != download.split_documents(docs, 0.1, 6)


def test_task_files_replace_synthetic_sets(tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text(
        json.dumps(
            {
                "family": "arithmetic",
                "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2."}],
            }
        )
        + "\n"
    )
    _, _, sets, meta = download.collect(data_cfg(sft_files=str(sft)))
    assert len(sets["sft"]) == 1 and meta["task_sets"]["sft"] == f"files:{sft}"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"family": "poetry", "prompt": "x", "chat_prompt": "y", "spec": {}}))
    with pytest.raises(StagelmError, match=r"bad\.jsonl:1: unknown family 'poetry'"):
        download.collect(data_cfg(eval_files=str(tmp_path / "bad.jsonl")))


def test_bad_sources_fail_with_one_named_line(tmp_path):
    cases = []
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    cases.append((data_cfg(source=f"files:{empty}"), r"^data\.source: .* holds no non-empty documents"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    cases.append((data_cfg(source=f"files:{latin}"), rf"^{latin}: not UTF-8 text"))
    jsonl = write_docs(tmp_path, "jsonl", TEXTS, field="body")
    cases.append((data_cfg(source=f"files:{jsonl}"), r"^data\.text_field: .* has no column 'text'"))
    cases.append((data_cfg(source=f"files:{tmp_path}/nothing*.txt"), r"^data\.source: .* matches no"))
    cases.append((data_cfg(source="s3://bucket/corpus"), r"^data\.source: unknown source"))
    cases.append((data_cfg(source="hf:someone/some-dataset", hf_revision=None), r"^data\.hf_revision: pin"))
    for cfg, pattern in cases:
        with pytest.raises(StagelmError, match=pattern):
            download.collect(cfg)


def test_unreachable_hub_fails_fast(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    t0 = time.perf_counter()
    with pytest.raises(StagelmError, match=r"^data\.source: the Hugging Face hub is unreachable"):
        download.collect(data_cfg(source="hf:someone/some-dataset", hf_revision="main"))
    assert time.perf_counter() - t0 < 5


def test_hub_probe_really_times_out_here():
    t0 = time.perf_counter()
    download.hub_reachable(timeout=2.0)
    assert time.perf_counter() - t0 < 4


def test_stage_exits_nonzero_with_one_line(tmp_path):
    params = micro_params(data={"source": "files:does/not/exist/*.txt"})
    write_params(tmp_path / "params.yaml", params)
    result = run(
        [sys.executable, str(ROOT / "stages/download.py"), "--params", "params.yaml", "--out", "raw"],
        tmp_path,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: data.source:")
    assert not (tmp_path / "raw").exists()
