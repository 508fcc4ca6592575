"""download stage: read the corpus and task sets named by `data.*`, split, write Parquet.

python stages/download.py --params params.yaml --out data/raw
"""

from stagelm.config import load_section, section_dict
from stagelm.download import collect, match_files, write_raw
from stagelm.errors import run_main
from stagelm.stage import start


def main() -> None:
    stage = start(__doc__, "out")
    args = stage.args
    cfg = load_section(stage.params, "data")

    train, val, sets, meta = collect(cfg)
    manifest = write_raw(args.out, train, val, sets, meta)

    inputs = {}
    if cfg.source.startswith("files:"):
        inputs = {str(p): p for p in match_files(cfg.source.removeprefix("files:"))}
    stage.record(args.out / "provenance.json", {"data": section_dict(cfg)}, inputs)
    docs = manifest["documents"]
    print(
        f"download: {docs['train']} train + {docs['val']} val documents from {manifest['source']}; "
        f"tasks {manifest['families']}"
    )


if __name__ == "__main__":
    run_main(main)
