"""The data path at scale: time and peak memory of the tokenizer and pack stages (dev script).

    python benchmarks/data_scale.py --chars 1e8          # 100 M characters of training text
    python benchmarks/data_scale.py --chars 1e9 --work /tmp/scale

Builds a raw folder as the download stage lays it out: `corpus_train.parquet` holds
the synthetic corpus (seed 0) repeated, each copy's documents suffixed with their
copy and index so no two are equal, until it reaches `--chars` characters (written in
row groups, never held whole); `corpus_val` and `sft` are the synthetic source's own
at its default sizes. Then it runs `stages/tokenizer.py` and `stages/pack.py` on it as
subprocesses, one at a time, and prints one JSON line per stage: wall seconds and that
child's own peak RSS (`os.wait4`, not the running maximum over all children), plus
characters/s for the tokenizer and tokens/s and bytes per token on disk for pack.
The download stage is not measured here: it still reads every document into memory.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stagelm import synthetic
from stagelm.files import read_json, sha256_file, write_json

ROOT = Path(__file__).resolve().parents[1]


def build_raw(raw: Path, chars: int) -> int:
    """A raw folder whose train split holds at least `chars` characters; returns how many it holds."""
    raw.mkdir(parents=True, exist_ok=True)
    generated = synthetic.generate(0, 16000, 6000, 1, 1)
    base = generated["corpus"]
    total, copy = 0, 0
    with pq.ParquetWriter(raw / "corpus_train.parquet", pa.schema([("text", pa.string())])) as writer:
        while total < chars:
            docs = [f"{doc} ({copy}.{i})" for i, doc in enumerate(base)]
            total += sum(map(len, docs))
            writer.write_table(pa.table({"text": docs}))
            copy += 1
    pq.write_table(pa.table({"text": base[:800]}), raw / "corpus_val.parquet")
    sft = generated["sft"]
    pq.write_table(
        pa.table({"family": [c["family"] for c in sft], "messages": [c["messages"] for c in sft]}), raw / "sft.parquet"
    )
    files = {
        name: {"file": f"{name}.parquet", "sha256": sha256_file(raw / f"{name}.parquet")}
        for name in ("corpus_train", "corpus_val", "sft")
    }
    write_json(raw / "manifest.json", {"files": files})
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
    parser.add_argument("--chars", type=float, required=True, help="characters of training text, e.g. 1e9")
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed)")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        raw, tok, packed = work / "raw", work / "tokenizer", work / "packed"
        chars = build_raw(raw, int(args.chars))
        py, params = sys.executable, str(args.params)
        tokenizer = run_stage([py, "stages/tokenizer.py", "--params", params, "--raw", str(raw), "--out", str(tok)])
        tokenizer.update(stage="tokenizer", train_chars=chars, chars_per_sec=round(chars / tokenizer["seconds"]))
        print(json.dumps(tokenizer))
        pack = run_stage(
            [py, "stages/pack.py", "--params", params, "--raw", str(raw), "--tokenizer", str(tok), "--out", str(packed)]
        )
        manifest = read_json(packed / "train/manifest.json")
        on_disk = sum((packed / "train" / s["file"]).stat().st_size for s in manifest["shards"])
        tokens = manifest["tokens"]
        pack.update(
            stage="pack",
            train_chars=chars,
            train_tokens=tokens,
            tokens_per_sec=round(tokens / pack["seconds"]),
            train_bytes_per_token=round(on_disk / tokens, 2),
        )
        print(json.dumps(pack))


if __name__ == "__main__":
    main()
