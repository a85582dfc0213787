#!/usr/bin/env bash
# Trains models/kjv-v4-wide (V4-Flash attention shapes, tools/train_small_model/model_config.py
# shape "wide") on one H200 and packs what train.py wrote so that the device tool brings it back
# (at most 8 files of 16 MiB): the bf16 model.safetensors in 15 MiB pieces (model.part.*, joined
# with cat) and everything else in one gzip tar (rest.tgz), plus the console log.
#
# Prepare here (repository root; .device-carry/ is git-ignored and travels with `carry`):
#   python3 tools/train_small_model/build_data.py --out .device-carry/prodshape/data \
#       --fixtures tests/fixtures/wide_model --prose every-sentence --context 4096 \
#       --long-fixture 2400:64
#   cp tools/train_small_model/*.py tools/gpu/train_prodshape.sh .device-carry/prodshape/
# then on the GPU machine (carry .device-carry/prodshape):
#   bash .device-carry/prodshape/train_prodshape.sh .device-carry/prodshape "$OUT"
# and back here: tools/train_small_model/install_wide.sh DIR_WITH_THOSE_FILES
#
# The training budget (--budget 210 s) and the timeout keep the whole command under 8 minutes.
set -uo pipefail
carry="$(cd "$1" && pwd)"
out="$2"
work=/tmp/prodshape-run
rm -rf "$work" && mkdir -p "$work" "$out"
cd "$carry"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 450 python3 train.py --shape wide --data data --out "$work" --budget 210 --batch 2 \
  --eval-batch 2 --slice-on cuda --context 4096 --lr 0.002 --min-lr-frac 0.1 --warmup 60 \
  --weight-decay 0.1 --dropout 0.1 --bias-rate 0.001 --clip 1.0 --indexer-loss 1.0 \
  --max-epochs 10.0 --eval-every 25 --patience 10 --measure-from 5 --measure-steps 15 \
  --samples 20 --sample-tokens 200 --seed 1611 2>&1 | tee "$out/train.log"
echo "train.py exit ${PIPESTATUS[0]}"
if [ -f "$work/model/model.safetensors" ]; then
  split -b 15M -d "$work/model/model.safetensors" "$out/model.part."
  rm "$work/model/model.safetensors"
fi
tar -czf "$out/rest.tgz" -C "$work" .
ls -la "$out"
