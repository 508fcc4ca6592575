#!/usr/bin/env bash
# On a TPU machine, from the repository root: time the decode kernel alone per block shape
# (benchmarks/decode_kernel.py), then profile generation (benchmarks/decode_profile.py, through
# tpu.sh) with the shape fastest at batch 256. Both results land in $1 (a folder).
set -euo pipefail
out="$1"
shift
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 200 python3 benchmarks/decode_kernel.py --batches 8 64 256 \
  --blocks "${KERNEL_BLOCKS:-4x128,8x64,8x128,8x256,16x64,16x128}" 2>/dev/null | tail -1 >"$out/kernel.json"
best=$(python3 -c "
import json, sys
runs = json.load(open(sys.argv[1]))['runs']
row = next(r for r in runs if r['batch'] == 256)
print(min((v['ms'], k) for k, v in row.items() if isinstance(v, dict))[1])" "$out/kernel.json")
cut -c1-2500 "$out/kernel.json"
echo "blocks: $best"
STAGELM_SCRIPT=benchmarks/decode_profile.py bash benchmarks/tpu.sh --out "$out/decode.json" --blocks "$best" "$@"
