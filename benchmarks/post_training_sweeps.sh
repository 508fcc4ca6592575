#!/usr/bin/env bash
# The sweeps behind the GRPO and distillation defaults (docs/grpo.md, docs/distillation.md),
# queued as DVC experiments from the checked-out commit. Run from the repository root:
#
#   bash benchmarks/post_training_sweeps.sh grpo1     # or distill1, grpo3seeds, ...
#   dvc queue start --jobs 1                          # then wait: dvc queue status
#   python benchmarks/sweep.py table <params...> --rev <commit>
#
# Every GRPO point is sized in samples (completions generated, `--samples`), so variants
# compare at equal samples rather than equal steps. The table commands for each round are in
# the docs beside the tables.
set -euo pipefail
Q="python benchmarks/sweep.py queue"
case "${1:?which sweep: grpo1 | distill1}" in
  grpo1)  # seed 0, 20,480 samples each (today's default drew 40 rollouts × 2 draws × 32 × 8)
    S="--samples 20480"
    P="grpo.dynamic_sampling=false"
    $Q $P grpo.objective=rft grpo.lr=3e-5,1e-4,3e-4 $S --prefix r1
    $Q $P grpo.objective=rft grpo.rft_keep=one grpo.lr=1e-4 $S --prefix r1one
    $Q $P grpo.objective=grpo grpo.negative_weight=0.0 grpo.lr=3e-5,1e-4 $S --prefix r1pos
    $Q $P grpo.objective=grpo grpo.lr=3e-5 $S --prefix r1grpo
    $Q $P grpo.objective=grpo grpo.reward=steps grpo.lr=3e-5 $S --prefix r1steps
    $Q $P grpo.objective=grpo grpo.prompts_per_step=128 grpo.grad_accum=4 grpo.lr=1e-4 $S --prefix r1big
    $Q $P grpo.objective=rft grpo.prompts_per_step=128 grpo.grad_accum=4 grpo.lr=3e-4 $S --prefix r1rftbig
    $Q $P grpo.objective=grpo grpo.optimizer=sgd grpo.lr=0.1 $S --prefix r1sgd
    ;;
  distill1)  # seed 0: the keys that exist, and the KL's direction
    $Q distill.alpha=1.0 distill.temperature=1.0,2.0 --prefix d1
    $Q distill.alpha=1.0 distill.temperature=1.0 distill.kl=reverse --prefix d1rev
    $Q distill.alpha=0.5 distill.temperature=1.0 --prefix d1half
    $Q distill.alpha=1.0 distill.temperature=1.0 distill.steps=75,300 distill.eval_every=75 --prefix d1steps
    ;;
  *) echo "unknown sweep $1" >&2; exit 2 ;;
esac
