"""download stage: read the corpus and task sets named by `data.*`, split, write Parquet.

python stages/download.py --params params.yaml --out data/raw

The corpus streams through in batches (memory does not grow with it); the manifest is
written last, so a killed run leaves no folder that looks done.
"""

from stagelm.data.download import write_download
from stagelm.infra.errors import run_main
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import beside, start


def main() -> None:
    stage = start(__doc__, "out")
    args = stage.args
    cfg = load_section(stage.params, "data")

    manifest, files = write_download(cfg, args.out)

    stage.record(beside(args.out), {"data": section_dict(cfg)}, {str(p): p for p in files})
    docs, chars = manifest["documents"], manifest["corpus_characters"]
    print(
        f"download: {docs['train']:,} train + {docs['val']:,} val documents "
        f"({chars['train'] + chars['val']:,} characters) from {manifest['source']}; tasks {manifest['families']}"
    )


if __name__ == "__main__":
    run_main(main)
