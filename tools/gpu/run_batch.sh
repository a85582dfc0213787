#!/usr/bin/env bash
# Several tools/gpu/run_<name>.sh scripts in one device call, one after another, so that one
# machine start serves them all (device time counts from the start: few, full calls cost less).
#   OUT=<dir> BUILD=<dir> bash tools/gpu/run_batch.sh STEP...
# STEP is NAME[@SECONDS][:VAR=VALUE[,VAR=VALUE...]]: runs tools/gpu/run_NAME.sh with those
# variables set, OUT=<tmp>/NAME and BUILD (one kernels/cuda build folder for every step: the
# standalone scripts configure it with the same flags, so later steps build only what they add),
# cut at SECONDS (default 150) and at what is left of BUDGET (default 560 s; a step that would
# start with less than 20 s left is skipped). Each step's whole output folder comes back as
# $OUT/NAME.tgz (the device returns at most 8 files, two folders down), its stdout in it as
# stdout.log; the last 30 lines of each step's stdout (the scripts print their table last) and a
# step table (name, exit status, seconds) are printed at the end.
# BATCH_TREES=<dir>: a step whose <dir>/NAME/tools/gpu/run_NAME.sh exists runs that script from
# <dir>/NAME (another branch's tree, e.g. `git archive BRANCH kernels bench tests tools
# CMakeLists.txt | tar -x -C <dir>/NAME`), with a build folder of its own (BUILD-NAME).
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
budget=${BUDGET:-560}
export BUILD=${BUILD:-/tmp/pdserve-batch-build}
tmp=$(mktemp -d /tmp/pdserve-batch.XXXXXX)
t0=$SECONDS
steps=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1
for spec in "$@"; do
  head=${spec%%:*}
  vars=""
  [ "$head" != "$spec" ] && vars=${spec#*:}
  name=${head%%@*}
  limit=150
  [ "$name" != "$head" ] && limit=${head#*@}
  script=tools/gpu/run_$name.sh
  root=.
  build=$BUILD
  if [ -n "${BATCH_TREES:-}" ] && [ -f "$BATCH_TREES/$name/$script" ]; then
    root=$BATCH_TREES/$name
    build=$BUILD-$name
  fi
  left=$((budget - (SECONDS - t0)))
  if [ ! -f "$root/$script" ]; then
    steps+=("| $name | missing $script | 0 |")
    continue
  fi
  if [ "$left" -lt 20 ]; then
    steps+=("| $name | skipped ($left s left) | 0 |")
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$tmp/$name"
  envs=("OUT=$tmp/$name" "BUILD=$build")
  if [ -n "$vars" ]; then
    IFS=',' read -r -a more <<<"$vars"
    envs+=("${more[@]}")
  fi
  echo "=== $name (from $root, limit $limit s; ${envs[*]})"
  s=$SECONDS
  (cd "$root" && env "${envs[@]}" timeout -k 5 "$limit" bash "$script") >"$tmp/$name/stdout.log" 2>&1
  rc=$?
  steps+=("| $name | $rc | $((SECONDS - s)) |")
  tar -czf "$out/$name.tgz" -C "$tmp" "$name" 2>/dev/null
done
for spec in "$@"; do
  head=${spec%%:*}
  name=${head%%@*}
  [ -f "$tmp/$name/stdout.log" ] || continue
  echo
  echo "=== $name: last lines"
  tail -n 30 "$tmp/$name/stdout.log"
done
echo
echo "| step | exit | s |"
echo "| --- | --- | --- |"
printf '%s\n' "${steps[@]}"
