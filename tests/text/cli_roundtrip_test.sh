#!/bin/sh
# `pdserve tokenize` then `pdserve detokenize --skip-special-tokens` gives back the input text
# (from --text and from --file), and a missing input is a usage error.
# Usage: cli_roundtrip_test.sh PDSERVE_BINARY MODEL_DIR
set -eu
pdserve="$1"
model="$2"
text='Hello, 世界! 👨‍👩‍👧‍👦 x=42; <｜User｜> stays text'
ids=$("$pdserve" tokenize --model "$model" --text "$text")
back=$("$pdserve" detokenize --model "$model" --ids "$ids" --skip-special-tokens)
[ "$back" = "$text" ] || { echo "round trip from --text: got '$back'"; exit 1; }
file=$(mktemp)
trap 'rm -f "$file"' EXIT
printf '%s' "$text" > "$file"
ids_file=$("$pdserve" tokenize --model "$model" --file "$file")
[ "$ids_file" = "$ids" ] || { echo "--file ids differ: $ids_file vs $ids"; exit 1; }
if "$pdserve" tokenize --model "$model" >/dev/null 2>&1; then
  echo "tokenize without --text/--file succeeded"; exit 1
fi
echo "ok: $ids"
