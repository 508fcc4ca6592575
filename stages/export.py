"""export stage: one model directory as a transformers Llama checkpoint and a llama.cpp GGUF.

    python stages/export.py --params params.yaml --model runs/sft/model --out runs/export/sft

Writes what `LlamaForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load
(stagelm.interop.hf_export) and, beside it, `model.gguf` for llama.cpp and Ollama
(stagelm.interop.gguf_export; matrices in `export.gguf_dtype`); its provenance goes beside
the folder, `<out>.provenance.json`.
"""

from stagelm.infra.errors import run_main
from stagelm.interop.gguf_export import export_gguf
from stagelm.interop.hf_export import export_hf
from stagelm.model.modeldir import PARAMS_FILE
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import beside, start


def main() -> None:
    stage = start(__doc__, "model", "out")
    args = stage.args
    cfg = load_section(stage.params, "export")
    export_hf(args.model, args.out)
    export_gguf(args.model, args.out / "model.gguf", cfg.gguf_dtype)
    stage.record(beside(args.out), {"export": section_dict(cfg)}, {"model": args.model / PARAMS_FILE})
    print(f"export: {args.model} → {args.out} (transformers, and model.gguf in {cfg.gguf_dtype})")


if __name__ == "__main__":
    run_main(main)
