"""pack stage: tokenize the raw splits and pack them into Arrow shards of fixed-length rows.

python stages/pack.py --params params.yaml --raw data/raw --tokenizer data/tokenizer --out data/packed

One process or many (`stagelm launch`), the output is the same bytes (stagelm.data.pack_splits).
Everything is written into a folder beside the output (`.packed.partial`), which
replaces the output only when all three splits are done: a failed or killed pack (a
full disk, a bad document) leaves the previous train, val and sft as they were.
"""

import shutil

from stagelm.data.pack_splits import pack_splits
from stagelm.infra import distributed
from stagelm.infra.errors import run_main
from stagelm.infra.files import replace_folder
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


if __name__ == "__main__":
    run_main(main)
