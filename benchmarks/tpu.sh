#!/usr/bin/env bash
# benchmarks/accelerator.py on a fresh TPU machine, in one command from the repository root:
#   bash benchmarks/tpu.sh --out benchmarks/results/accelerator-<date>.json
# (another script of benchmarks/ with STAGELM_SCRIPT, e.g. benchmarks/decode_profile.py).
# The machine's JAX (with libtpu) stays first; what else the decoder, the train step and the
# generator import (flax, optax, tokenizers, pyarrow, pyyaml, safetensors, filelock) comes from
# a local package index (PIP_INDEX, default the machine's own, file:///opt/pypi/simple), and
# wheels the index lacks (ruamel.yaml) from .whl-tpu/ (benchmarks/README.md, "On a TPU").
set -euo pipefail
cd "$(dirname "$0")/.."
site="${STAGELM_SITE:-/tmp/stagelm-site}"
index="${PIP_INDEX:-file:///opt/pypi/simple}"
start=$(date +%s)
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url "$index" \
  --target "$site" flax optax tokenizers pyarrow pyyaml safetensors filelock
if compgen -G ".whl-tpu/*.whl" >/dev/null; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --upgrade --target "$site" .whl-tpu/*.whl
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"
echo "tpu.sh: installed in $(( $(date +%s) - start )) s"
PYTHONUNBUFFERED=1 python3 "${STAGELM_SCRIPT:-benchmarks/accelerator.py}" "$@"
echo "tpu.sh: done in $(( $(date +%s) - start )) s"
