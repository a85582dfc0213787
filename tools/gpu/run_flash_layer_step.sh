#!/usr/bin/env bash
# One real-format V4-Flash layer's decode step in the CUDA engine (FP8 W8A16, the FP4 routed
# experts FP8 at load, 256 experts), unfused and fused: tools/make_real_format_checkpoint.py
# writes random checkpoints of 1 and 2 layers (5.3 / 8.7 GB; 36 / 50 s on the H200's host), and
# bench/engine/gpu_decode_step_bench times graph decode steps of each; one layer = the 2-layer
# step minus the 1-layer step (embedding, final head and lm_head cancel). docs/perf.md, "One
# real-format V4-Flash layer's decode step in the engine" (2026-12-04 20:49 UTC: these commands,
# run from the lead's round folder, committed here after the run).
#   here:  tools/gpu/pack_binaries.sh <dir> build/bench/engine/gpu_decode_step_bench
#   there: source <dir>/env.sh && OUT=<out> bash tools/gpu/run_flash_layer_step.sh  (repo root;
#          needs tests/fixtures/v4_configs, ~14 GB free in /tmp, python3)
# Environment: OUT (gpu-out/flash-layer), BATCHES (1,8,32,128). The table is printed last.
set -u
OUT=${OUT:-gpu-out/flash-layer}
mkdir -p "$OUT"
for n in 1 2; do
  s=$SECONDS
  timeout 90 python3 tools/make_real_format_checkpoint.py --out /tmp/flash$n --layers $n \
    --shapes flash > "$OUT/ckpt$n.log" 2>&1
  echo "checkpoint $n layers rc=$? $((SECONDS - s)) s $(du -sh /tmp/flash$n | cut -f1)"
done
for n in 1 2; do
  s=$SECONDS
  timeout 100 gpu_decode_step_bench --model /tmp/flash$n --weights fp8 --activations bf16 \
    --batches "${BATCHES:-1,8,32,128}" --steps 20 > "$OUT/bench$n.md" 2> "$OUT/bench$n.err"
  echo "bench $n layers rc=$? $((SECONDS - s)) s"
  tail -3 "$OUT/bench$n.err"
done
python3 - "$OUT/bench1.md" "$OUT/bench2.md" <<'PY'
import sys
def rows(p):
    d = {}
    for line in open(p):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) == 5:
            d[(c[1], int(c[2]))] = (float(c[3]), float(c[4]))
    return d
a, b = rows(sys.argv[1]), rows(sys.argv[2])
print("| mode | batch | 1 layer us | 2 layers us | one layer us (difference) | wall 1 / 2 us |")
print("| --- | --- | --- | --- | --- | --- |")
for k in sorted(b):
    if k in a:
        print(f"| {k[0]} | {k[1]} | {a[k][0]:.1f} | {b[k][0]:.1f} | {b[k][0]-a[k][0]:.1f} | "
              f"{a[k][1]:.1f} / {b[k][1]:.1f} |")
PY
