#!/usr/bin/env bash
# Pretraining recipes on a many-core CPU, several at once: each a copy of the project under
# `dvc exp run` on its own cores (taskset), through pretrain, SFT and their evals.
#   bash benchmarks/recipe_probe.sh OUT CORES NAME:key=value,key=value ...
# e.g. bash benchmarks/recipe_probe.sh out 2 b16s0:training.batch_size=16,seed=0 b16s1:...
# Each run's key figures go to OUT/<NAME>.json as it ends (benchmarks/README.md, "Recipes").
set -euo pipefail
out=$(realpath "$1"); cores=$2; shift 2
mkdir -p "$out"
copies=$(mktemp -d -t recipe-probe.XXXXXX)  # the project copies (data, models): not under OUT, which travels back
i=0
for spec in "$@"; do
  name=${spec%%:*}
  sets=()
  IFS=, read -ra pairs <<< "${spec#*:}"
  for pair in "${pairs[@]}"; do sets+=(-S "$pair"); done
  dir=$copies/$name
  mkdir -p "$dir"
  git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$dir"  # as the work tree holds them
  first=$((i * cores)); last=$((first + cores - 1)); i=$((i + 1))
  (
    cd "$dir"
    git init -q && git add -A && git -c user.email=p@p -c user.name=p commit -qm probe
    start=$(date +%s)
    JAX_PLATFORMS=cpu taskset -c "$first-$last" dvc exp run "${sets[@]}" eval@pretrain eval@sft \
      > "$out/$name.log" 2>&1 || echo "failed" >> "$out/$name.log"
    python3 benchmarks/recipe_figures.py "$name" "$(( $(date +%s) - start ))" "$spec" > "$out/$name.json"
  ) &
done
wait
cat "$out"/*.json
echo "recipe_probe: the project copies are in $copies"
