#!/usr/bin/env bash
# GPU recipe: one tandem (gspo, dfpo-min) of a Qwen3-0.6B-shaped random-init model,
# bf16 autocast over fp32 weights, 32 prompts × G = 8 × 1024 new tokens, --micro-batch 16, on
# one GPU. Prints step time, peak GPU memory and the probe overhead ratio (update + probes) /
# update. NOT YET RUN ON A GPU (README, "Real-scale loop").
#
#   bash analyses/benchmarks/gpu_smoke.sh [WORKDIR] [extra gradlab tandem options...]
#   GPU_SMOKE_SMALL=1 DEVICE=cpu bash analyses/benchmarks/gpu_smoke.sh /tmp/smoke --prompts 2 --G 2 \
#       --max-new-tokens 8 --micro-batch 2 --minibatches 2   # a CPU dry run of the script itself
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-runs/gpu_smoke}; shift || true
DEVICE=${DEVICE:-cuda}
MODEL="$WORK/model"
if [ ! -f "$MODEL/config.json" ]; then
  python -m analyses.benchmarks.gpu_smoke build "$MODEL" ${GPU_SMOKE_SMALL:+--small}
fi
AMP=--amp
[ "$DEVICE" = cpu ] && AMP=--no-amp
python -m analyses.benchmarks.gpu_smoke run "$MODEL" "$WORK/run" \
  --objectives gspo,dfpo-min --device "$DEVICE" $AMP \
  --prompts 32 --G 8 --max-new-tokens 1024 --micro-batch 16 --minibatches 4 \
  --steps 2 --tax-every 2 --probe-contexts 4 --ckpt-every 1000 --no-progress "$@"
