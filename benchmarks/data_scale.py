"""The data path at scale: time and peak memory of the download, tokenizer and pack stages (dev script).

    python benchmarks/data_scale.py --chars 1e8          # 100 M characters of text
    python benchmarks/data_scale.py --chars 1e9 --work scale-work --format jsonl.gz

Writes a corpus folder as a user would bring one: files of about 100 MB of text each
(`--format` txt, jsonl, jsonl.gz or parquet) holding the synthetic corpus (seed 0)
repeated, each copy's documents suffixed with their copy and index so no two are
equal, until it reaches `--chars` characters. Then it runs `stages/download.py`
(`data.source: files:<folder>`), `stages/tokenizer.py` and `stages/pack.py` on it as
subprocesses, one at a time, and prints one JSON line per stage: wall seconds and that
child's own peak RSS (`os.wait4`, not the running maximum over all children), plus
MB/s of text for download, characters/s for the tokenizer, and for pack tokens/s,
bytes per token on disk and its speed over `Tokenizer.encode_batch` (and
`encode_batch_fast`, which pack calls) alone on the same text, timed in another child
with both cores busy in both. The corpus is written by a child too, so this process
stays small: a child's peak RSS counts the parent's memory at the fork.
"""

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from stagelm.infra.files import read_json

ROOT = Path(__file__).resolve().parents[1]
FILE_CHARS = 100_000_000  # text per corpus file

ENCODE_ONLY = """
import sys, time
from stagelm.data.rawdata import iter_column
from stagelm.data.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[2])
encode = getattr(tok, sys.argv[3])
t0, tokens = time.perf_counter(), 0
for split in ("train", "val"):
    for texts in iter_column(sys.argv[1], f"corpus_{split}", "text"):
        tokens += sum(len(e) for e in encode(texts, add_special_tokens=False))
print(tokens, time.perf_counter() - t0)
"""


def write_corpus(folder: Path, chars: int, fmt: str) -> int:
    """Corpus files of `fmt` in `folder` holding at least `chars` characters; returns how many."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stagelm.data import synthetic

    folder.mkdir(parents=True, exist_ok=True)
    base = synthetic.generate(0, 16000, 1, 1, 1)["corpus"]
    total, copy, number = 0, 0, 0
    while total < chars:
        docs, size = [], 0
        while size < FILE_CHARS and total + size < chars:
            batch = [f"{doc} ({copy}.{i})" for i, doc in enumerate(base)]
            docs += batch
            size += sum(map(len, batch))
            copy += 1
        path = folder / f"part-{number:04d}.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.table({"text": docs}), path)
        elif fmt == "txt":
            path.write_text("\n\n".join(docs) + "\n")
        else:
            data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
            path.write_bytes(gzip.compress(data, 1) if fmt.endswith(".gz") else data)
        total += size
        number += 1
    return total


def run_stage(cmd: list[str]) -> dict:
    """Wall seconds and peak RSS (bytes) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{cmd[1]} failed:\n{out}")
    return {"seconds": round(seconds, 2), "peak_rss_bytes": usage.ru_maxrss * 1024, "output": out.strip().splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=float, required=True, help="characters of text, e.g. 1e9")
    parser.add_argument("--format", default="jsonl", choices=["txt", "jsonl", "jsonl.gz", "parquet"])
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed)")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--write-corpus", type=Path, help=argparse.SUPPRESS)  # the child that writes it
    args = parser.parse_args()
    if args.write_corpus:
        print(write_corpus(args.write_corpus, int(args.chars), args.format))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        corpus, raw, tok, packed = work / "corpus", work / "raw", work / "tokenizer", work / "packed"
        writer = [sys.executable, __file__, "--chars", str(args.chars), "--format", args.format]
        chars = int(subprocess.run([*writer, "--write-corpus", str(corpus)], capture_output=True, check=True).stdout)
        params = yaml.safe_load(args.params.read_text())
        params["data"]["source"] = f"files:{corpus}"
        params_file = work / "params.yaml"
        params_file.write_text(yaml.safe_dump(params, sort_keys=False))
        py, p = sys.executable, str(params_file)

        download = run_stage([py, "stages/download.py", "--params", p, "--out", str(raw)])
        download.update(stage="download", chars=chars, mb_per_sec=round(chars / 1e6 / download["seconds"], 1))
        print(json.dumps(download), flush=True)
        tokenizer = run_stage([py, "stages/tokenizer.py", "--params", p, "--raw", str(raw), "--out", str(tok)])
        tokenizer.update(stage="tokenizer", chars_per_sec=round(chars / tokenizer["seconds"]))
        print(json.dumps(tokenizer), flush=True)
        pack = run_stage(
            [py, "stages/pack.py", "--params", p, "--raw", str(raw), "--tokenizer", str(tok), "--out", str(packed)]
        )
        tokens = on_disk = 0
        for split in ("train", "val"):
            manifest = read_json(packed / split / "manifest.json")
            on_disk += sum((packed / split / s["file"]).stat().st_size for s in manifest["shards"])
            tokens += manifest["tokens"]
        pack.update(
            stage="pack",
            corpus_tokens=tokens,
            tokens_per_sec=round(tokens / pack["seconds"]),
            corpus_bytes_per_token=round(on_disk / tokens, 2),
        )
        for method in ("encode_batch", "encode_batch_fast"):
            encode = [py, "-c", ENCODE_ONLY, str(raw), str(tok / "tokenizer.json"), method]
            encoded, encode_s = subprocess.run(encode, capture_output=True, text=True, check=True).stdout.split()
            pack[f"{method}_tokens_per_sec"] = round(int(encoded) / float(encode_s))
            pack[f"pack_over_{method}"] = round(float(encode_s) / pack["seconds"], 3)
        print(json.dumps(pack), flush=True)
        total = download["seconds"] + tokenizer["seconds"] + pack["seconds"]
        print(json.dumps({"stage": "data path", "chars": chars, "seconds": round(total, 1)}))


if __name__ == "__main__":
    main()
