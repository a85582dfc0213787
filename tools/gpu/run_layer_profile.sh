#!/usr/bin/env bash
# Where one real-format V4-Flash layer's decode step goes, kernel by kernel (issue 25's "one
# V4-Flash layer's full decode step ... with its bandwidth floor beside it"): a random 1-layer
# checkpoint in DeepSeek's release layout (tools/make_real_format_checkpoint.py, ~5.3 GB), the
# engine's graph decode steps (bench/engine/gpu_decode_step_bench, W8A16, fused projections, the
# default) timed plainly, then the same timed steps under Nsight Compute with only the timed
# steps profiled (--profile-timed + ncu --profile-from-start off; gpu__time_duration.sum of every
# kernel; ncu runs kernels one at a time, so the per-kernel sum is a little above the graph's
# time). Per batch: us per step by kernel, launches per step, share; the table is printed last.
#   here:  cmake --build build --target gpu_decode_step_bench
#          tools/gpu/run_layer_profile.sh pack          # .device-carry/layer_profile.tar.xz
#   there: OUT=<dir> bash tools/gpu/run_layer_profile.sh    (repository root; ~14 GB in /tmp)
# Environment: OUT (gpu-out/layer-profile), BATCHES (1 32), PROMPT (64), STEPS (8).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  tmp=$(mktemp -d)
  tools/gpu/pack_binaries.sh "$tmp/layer_profile" "${BUILD:-build}/bench/engine/gpu_decode_step_bench" \
    > /dev/null
  mkdir -p .device-carry
  (cd "$tmp" && tar -cf - layer_profile | xz -6 -T0) > .device-carry/layer_profile.tar.xz
  rm -rf "$tmp"
  ls -la .device-carry/layer_profile.tar.xz
  exit 0
fi
out=${OUT:-gpu-out/layer-profile}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ ! -x .device-carry/layer_profile/bin/gpu_decode_step_bench ]; then
  tar -xJf .device-carry/layer_profile.tar.xz -C .device-carry ||
    { echo "FAIL: no .device-carry/layer_profile.tar.xz (run '$0 pack' here first)"; exit 2; }
fi
# shellcheck disable=SC1091
source .device-carry/layer_profile/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
prompt=${PROMPT:-64}
steps=${STEPS:-8}
ckpt=/tmp/flash1
if [ ! -f $ckpt/model.safetensors.index.json ]; then
  s=$SECONDS
  timeout 120 python3 tools/make_real_format_checkpoint.py --out $ckpt --layers 1 \
    --shapes flash > "$out/ckpt.log" 2>&1
  echo "checkpoint rc=$? $((SECONDS - s)) s $(du -sh $ckpt | cut -f1)"
fi
bench=(gpu_decode_step_bench --model $ckpt --weights fp8 --activations bf16 --projections fused
  --prompt "$prompt")
for b in ${BATCHES:-1 32}; do
  s=$SECONDS
  timeout 120 "${bench[@]}" --batches "$b" --steps 20 > "$out/plain$b.md" 2> "$out/plain$b.err"
  echo "plain batch $b rc=$? $((SECONDS - s)) s: $(cat "$out/plain$b.md")"
  s=$SECONDS
  timeout 240 ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file "$out/ncu$b.csv" \
    "${bench[@]}" --batches "$b" --steps "$steps" --profile-timed > "$out/ncu$b.md" 2> "$out/ncu$b.err"
  echo "ncu batch $b rc=$? $((SECONDS - s)) s"
  tail -2 "$out/ncu$b.err"
done
python3 - "$out" "$steps" ${BATCHES:-1 32} <<'PY' | tee "$out/table.md"
import csv, re, sys
out, steps, batches = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def short(name):
    name = re.sub(r"\(.*$", "", name)            # arguments
    name = re.sub(r"^(void |pdserve::)+", "", name)
    name = re.sub(r"pdserve::kernels::cuda::", "", name)
    return name[:70]
for b in batches:
    plain = open(f"{out}/plain{b}.md").read().strip()
    rows = []
    try:
        with open(f"{out}/ncu{b}.csv") as f:
            lines = [l for l in f if l.startswith('"')]
        for r in csv.DictReader(lines):
            if r.get("Metric Name") == "gpu__time_duration.sum":
                rows.append((short(r["Kernel Name"]), float(r["Metric Value"].replace(",", "")) / 1000.0))
    except Exception as e:  # noqa: BLE001 -- report and go on
        print(f"batch {b}: no ncu rows ({e})")
        continue
    agg = {}
    for n, us in rows:
        t, c = agg.get(n, (0.0, 0))
        agg[n] = (t + us, c + 1)
    total = sum(t for t, _ in agg.values()) / steps
    print(f"\nbatch {b}: plain run {plain}")
    print(f"ncu: {len(rows) / steps:.0f} kernels a step, {total:.1f} us a step (sum of kernels)\n")
    print("| kernel | us / step | launches / step | share |")
    print("| --- | --- | --- | --- |")
    for n, (t, c) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"| `{n}` | {t / steps:.1f} | {c / steps:g} | {100 * t / steps / total:.1f}% |")
PY
