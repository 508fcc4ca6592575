"""export stage: one model directory as a transformers Llama checkpoint.

    python stages/export.py --model runs/sft/model --out runs/export/sft

Writes what `LlamaForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (see stagelm.hf); its provenance goes beside it, `<out>.provenance.json`.
"""

from stagelm.errors import run_main
from stagelm.hf import export_hf
from stagelm.modeldir import PARAMS_FILE
from stagelm.stage import beside, start


def main() -> None:
    stage = start(__doc__, "model", "out")
    args = stage.args
    export_hf(args.model, args.out)
    stage.record(beside(args.out), {}, {"model": args.model / PARAMS_FILE})
    print(f"export: {args.model} → {args.out}")


if __name__ == "__main__":
    run_main(main)
