"""download stage: read the corpus and task sets named by `data.*`, split, write Parquet.

python stages/download.py --params params.yaml --out data/raw
"""

import argparse
from pathlib import Path

from stagelm.config import load_section, read_params, section_dict
from stagelm.download import collect, match_files, write_raw
from stagelm.errors import run_main
from stagelm.provenance import now, write_provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    started = now()
    cfg = load_section(read_params(args.params), "data")

    train, val, sets, meta = collect(cfg)
    manifest = write_raw(args.out, train, val, sets, meta)

    inputs = {}
    if cfg.source.startswith("files:"):
        inputs = {str(p): p for p in match_files(cfg.source.removeprefix("files:"))}
    write_provenance(args.out / "provenance.json", "download", {"data": section_dict(cfg)}, inputs, started)
    docs = manifest["documents"]
    print(
        f"download: {docs['train']} train + {docs['val']} val documents from {manifest['source']}; "
        f"tasks {manifest['families']}"
    )


if __name__ == "__main__":
    run_main(main)
