"""export stage: one model directory as a transformers Llama checkpoint.

    python stages/export.py --model runs/sft/model --out runs/export/sft

Writes what `LlamaForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (see stagelm.hf), plus provenance.json.
"""

import argparse
from pathlib import Path

from stagelm.errors import run_main
from stagelm.hf import export_hf
from stagelm.provenance import now, write_provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    started = now()
    export_hf(args.model, args.out)
    write_provenance(args.out / "provenance.json", "export", {}, {"model": args.model / "params"}, started)
    print(f"export: {args.model} → {args.out}")


if __name__ == "__main__":
    run_main(main)
