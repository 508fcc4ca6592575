#!/usr/bin/env bash
# GRPO and eval at a real size on one accelerator (issue 69): the grpo and eval stages on a model of
# the SmolLM2-135M shape (d 576, 30 layers, 9 heads of 64, 3 kv heads, bf16; the lab's own tokenizer)
# whose weights are one scanned pretraining step from random: the stages' throughput, not their
# learning. Run from the project root after ../shared/tpu/venv.sh (dvc and stagelm on the machine's JAX):
#   bash benchmarks/rl_on_chip.sh OUT [key=value ...]      # key=value: more params for grpo and eval
# OUT/rl.json: benchmarks/rl_figures.py's figures (rollout tokens/s, the update's MFU, stage times).
set -euo pipefail
out=$(realpath "$1"); shift
mkdir -p "$out"
start=$(date +%s)
shape=(model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.d_ff=1536 model.dtype=bfloat16
  distill.student.d_model=576 distill.student.n_heads=9 distill.student.n_kv_heads=3)
python3 benchmarks/rl_figures.py 0 --write-params params.yaml "${shape[@]}" grpo.steps=16 grpo.warmup_steps=2 \
  grpo.eval_every=16 grpo.checkpoint_every=8 "$@"
python3 benchmarks/rl_figures.py 0 --write-params "$out/init.yaml" --from params.yaml training.steps=1 \
  training.warmup_steps=0 training.eval_every=1 training.checkpoint_every=1 model.scan_layers=true
dvc repro pack > "$out/dvc.log" 2>&1
stage() { echo "$*" >> "$out/stages.log"; PYTHONPATH=src python3 "$@" >> "$out/stages.log" 2>&1; }
stage stages/pretrain.py --params "$out/init.yaml" --train data/packed/train --val data/packed/val \
  --tokenizer data/tokenizer/tokenizer.json --out runs/pretrain --checkpoints runs/.checkpoints/pretrain
stage stages/grpo.py --params params.yaml --model runs/pretrain/model --raw data/raw --val data/packed/val \
  --out runs/grpo --checkpoints runs/.checkpoints/grpo
stage stages/eval.py --params params.yaml --model runs/grpo/model --name grpo --format chat --val data/packed/val \
  --raw data/raw --inputs inputs --out runs/eval/grpo
python3 benchmarks/rl_figures.py $(( $(date +%s) - start )) --note "${shape[*]} $*" > "$out/rl.json"
cat "$out/rl.json"
