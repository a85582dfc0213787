#!/usr/bin/env bash
# One real-format V4-Flash layer's decode step in the CUDA engine (FP8 W8A16, fused projections,
# the FP4 routed experts FP8 at load) with this build's kernels against the build before, in one
# device call (<= BUDGET s, default 400): tools/make_real_format_checkpoint.py writes random
# checkpoints of 1 and 2 layers (both at once, while nothing else runs), then
# bench/engine/gpu_decode_step_bench times graph decode steps of each (median device time of 20,
# 64-token prompts), this build (NAME) and the build before (BASE) alternating, twice each, and
# this build with VARIANT_ENV (optional, e.g. PDSERVE_MOE_DIRECT=group) once; one layer = the
# 2-layer step minus the 1-layer step (embedding, final head and lm_head cancel).
# Here (each build's gpu_decode_step_bench packed with its libraries):
#   tools/gpu/pack_binaries.sh /tmp/p/NAME build/bench/engine/gpu_decode_step_bench
#   (cd /tmp/p && XZ_OPT=-9 tar -cJf "$OLDPWD/.device-carry/NAME.tar.xz" NAME)   # and BASE
# There (carry both; needs ~14 GB free in /tmp and python3 with numpy):
#   OUT=<dir> NAME=<pack> BASE=<pack> [VARIANT_ENV=K=V] [BATCHES=1,8,32] bash tools/gpu/run_step67.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
name=${NAME:?NAME, this build pack}
base_name=${BASE:?BASE, the pack of the build before}
out=${OUT:-gpu-out/step67}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-400}
for pack in "$name" "$base_name"; do
  [ -d ".device-carry/$pack" ] || tar -xJf ".device-carry/$pack.tar.xz" -C .device-carry
done
echo "cores $(nproc); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
s=$(date +%s)
for n in 1 2; do
  [ -f "/tmp/flash$n/model.safetensors.index.json" ] && continue
  timeout -k 5 "$(cap 150)" python3 tools/make_real_format_checkpoint.py --out "/tmp/flash$n" \
    --layers "$n" --shapes flash > "$out/ckpt$n.log" 2>&1 &
done
wait
made=0
for n in 1 2; do [ -f "/tmp/flash$n/model.safetensors.index.json" ] && made=$((made + 1)); done
row checkpoints "$made of 2" "$(($(date +%s) - s)) s"

# bench TAG PACK N [ENV]: one gpu_decode_step_bench run of PACK's binary on the N-layer checkpoint.
bench() {
  local tag=$1 pack=$2 n=$3 envset=${4:-}
  may || return 0
  (
    # shellcheck disable=SC1090
    source ".device-carry/$pack/env.sh"
    if [ -n "$envset" ]; then export "${envset?}"; fi
    timeout -k 5 "$(cap 60)" gpu_decode_step_bench --model "/tmp/flash$n" --weights fp8 \
      --activations bf16 --projections fused --prompt 64 --batches "${BATCHES:-1,8,32}" \
      --steps 20 > "$out/${tag}_$n.md" 2>> "$out/bench.err"
  )
}
s=$(date +%s)
for round in 1 2; do
  for n in 1 2; do
    bench "new$round" "$name" "$n"
    bench "base$round" "$base_name" "$n"
  done
done
if [ -n "${VARIANT_ENV:-}" ]; then
  for n in 1 2; do bench variant1 "$name" "$n" "$VARIANT_ENV"; done
fi
row steps "done" "$(($(date +%s) - s)) s"

echo "== one layer (2-layer step - 1-layer step), device us per step; whole 1-layer steps in ()"
python3 - "$out" <<'PY'
import sys, glob, os, collections
out = sys.argv[1]
def rows(p):
    d = {}
    try:
        for line in open(p):
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) == 5:
                try:
                    d[int(c[2])] = float(c[3])
                except ValueError:
                    pass
    except OSError:
        pass
    return d
tags = sorted({os.path.basename(p).rsplit("_", 1)[0] for p in glob.glob(f"{out}/*_1.md")})
print("| batch | " + " | ".join(tags) + " |")
print("| --- | " + " | ".join("---" for _ in tags) + " |")
one = {t: rows(f"{out}/{t}_1.md") for t in tags}
two = {t: rows(f"{out}/{t}_2.md") for t in tags}
batches = sorted({b for t in tags for b in two[t]})
for b in batches:
    cells = []
    for t in tags:
        if b in one[t] and b in two[t]:
            cells.append(f"{two[t][b] - one[t][b]:.1f} ({one[t][b]:.1f})")
        else:
            cells.append("-")
    print(f"| {b} | " + " | ".join(cells) + " |")
PY
# One file back (the device tool returns a few): TAG_N: the bench's rows.
for f in "$out"/*_[12].md; do
  [ -f "$f" ] || continue
  sed "s/^/$(basename "$f" .md) /" "$f"
  rm -f "$f"
done > "$out/steps.md"
printf '%s\n' "${rows[@]}"
