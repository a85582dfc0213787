#!/usr/bin/env bash
# Installs what tools/gpu/train_prodshape.sh brought back from the GPU machine (DIR: model.part.*,
# rest.tgz, train.log) as models/kjv-v4-wide and tests/fixtures/wide_model: joins the model's
# pieces, unpacks the rest, then runs tools/train_small_model/install_outputs.sh (the NumPy
# reference on the fixture prompts, not on the held-out slice, and the model card).
# The held-out slice fixture (heldout_slice.txt / _ids.bin) comes from build_data.py's --fixtures.
# Usage: tools/gpu/install_prodshape.sh DIR [DATA_DIR]   (from the repository root;
#        DATA_DIR: build_data.py's --out, default .device-carry/prodshape/data)
set -euo pipefail
dir="$1"
data="${2:-.device-carry/prodshape/data}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xzf "$dir/rest.tgz" -C "$work"
cat "$dir"/model.part.* > "$work/model/model.safetensors"
MODEL_DIR=models/kjv-v4-wide FIXTURES_DIR=tests/fixtures/wide_model REFERENCE_PERPLEXITY=0 \
  tools/train_small_model/install_outputs.sh "$work" "$data" "$dir/train.log"
