#!/usr/bin/env bash
# Copies what train.py wrote (its --out directory) into the repository: the model into
# models/kjv-v4-tiny, the logits fixtures and samples into tests/fixtures/small_model, the run's
# figures into models/kjv-v4-tiny/training, re-derives the indexer tie report with the NumPy
# reference (a few minutes), then regenerates MODEL_CARD.md.
# Usage: tools/train_small_model/install_outputs.sh OUT_DIR DATA_DIR [TRAIN_LOG]
#        (from the repository root; TRAIN_LOG: train.py's console output, kept as training/log.txt)
# Environment: MODEL_DIR (default models/kjv-v4-tiny), FIXTURES_DIR (default
# tests/fixtures/small_model), REFERENCE_PERPLEXITY=0 skips the NumPy reference's held-out slice
# perplexity (minutes at the wide model's 4096-token chunks).
set -euo pipefail
out="$1"
data="$2"
log="${3:-}"
model="${MODEL_DIR:-models/kjv-v4-tiny}"
fixtures="${FIXTURES_DIR:-tests/fixtures/small_model}"
perplexity=(--perplexity)
if [ "${REFERENCE_PERPLEXITY:-1}" = 0 ]; then perplexity=(); fi
mkdir -p "$model/training" "$fixtures"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json model.safetensors; do
  install -m 644 "$out/model/$f" "$model/$f"
done
install -m 644 "$out/loss.png" "$model/loss.png"
install -m 644 "$out/loss.csv" "$out/results.json" "$data/data.json" "$model/training/"
install -m 644 "$out"/fixtures/* "$fixtures/"
install -m 644 "$out/samples.json" "$fixtures/transformers_samples.json"
if [ -n "$log" ]; then grep -v "Loading weights" "$log" | tr -d '\r' > "$model/training/log.txt"; fi
if [ -f "$out/coherence_eval.json" ]; then install -m 644 "$out/coherence_eval.json" "$model/training/"; fi
python3 tools/train_small_model/numpy_reference.py --model "$model" --fixtures "$fixtures" \
  --ties-out "$fixtures/indexer_ties.json" "${perplexity[@]}"
python3 tools/train_small_model/write_model_card.py --root . --model "$model" --fixtures "$fixtures"
