"""export stage: one model directory as a transformers Llama checkpoint and a llama.cpp GGUF.

    python stages/export.py --params params.yaml --model runs/sft/model --out runs/export/sft

Writes what `LlamaForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load
(stagelm.interop.hf_export) and, beside it, `model.gguf` for llama.cpp and Ollama
(stagelm.interop.gguf_export; matrices in `export.gguf_dtype`); its provenance goes beside
the folder, `<out>.provenance.json`. With `--eval` (the model's eval metrics.json), the
model's best sampled temperature (`chat_best_temperature`) becomes generation_config.json's
default, where transformers, vLLM and `stagelm serve` (after import-hf) sample it.
"""

from pathlib import Path

from stagelm.infra.errors import StagelmError, run_main
from stagelm.infra.files import read_json_object
from stagelm.interop.gguf_export import export_gguf
from stagelm.interop.hf_export import export_hf
from stagelm.model.modeldir import PARAMS_FILE
from stagelm.pipeline.params import load_section, section_dict
from stagelm.pipeline.stage import beside, start


def main() -> None:
    options = {"eval": {"type": Path, "help": "the model's eval metrics.json (its best temperature)"}}
    stage = start(__doc__, "model", "out", options=options)
    args = stage.args
    cfg = load_section(stage.params, "export")
    inputs, sampling = {"model": args.model / PARAMS_FILE}, {}
    if args.eval is not None:
        best = read_json_object(args.eval, "rerun the eval stage").get("chat_best_temperature")
        if best is not None and not isinstance(best, int | float):
            raise StagelmError(f"{args.eval}: chat_best_temperature {best!r} is not a number; rerun the eval stage")
        sampling = {} if best is None else {"temperature": float(best)}  # none when eval.temperatures is []
        inputs["eval"] = args.eval
    export_hf(args.model, args.out, sampling)
    export_gguf(args.model, args.out / "model.gguf", cfg.gguf_dtype)
    stage.record(beside(args.out), {"export": section_dict(cfg)}, inputs)
    default = f"; sampled at T={sampling['temperature']:g} by default" if sampling else ""
    print(f"export: {args.model} → {args.out} (transformers, and model.gguf in {cfg.gguf_dtype}{default})")


if __name__ == "__main__":
    run_main(main)
