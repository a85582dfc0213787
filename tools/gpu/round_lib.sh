# Sourced by the tools/gpu/run_*.sh scripts that share one device call: the time budget, the
# step table and the packed binaries. Needs t0 (the start, date +%s) and budget (seconds) set
# first: start_round NAME SECONDS sets them (budget: BUDGET, default SECONDS) and out (OUT,
# default gpu-out/NAME; made, absolute).
#   elapsed: seconds since t0 ("12 s"); cap N: N cut to what is left of the budget (3 s kept for
#   the tables; at least 1); may: whether a step may start (8 s or more left); row STEP RESULT
#   DETAIL: one line of the step table (rows); unpack NAME: NAME/ from NAME.tar.xz (a
#   tools/gpu/pack_binaries.sh pack) unless it is there, its env.sh sourced, the host printed;
#   pack_carry NAME BINARY...: here, .device-carry/NAME.tar.xz of those binaries (run from the
#   repository root; needs nothing above); engine_suite NAME [CAP]: the engine's GPU suite
#   (engine_gpu_tests of the pack NAME, at most CAP s, default 120) into $out/engine.log, its
#   row and failures in $out/engine.md (needs out).
rows=()
start_round() {
  out=${OUT:-gpu-out/$1}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  t0=$(date +%s)
  budget=${BUDGET:-$2}
}
elapsed() { echo "$(($(date +%s) - t0)) s"; }
cap() {
  local rest=$((budget - ($(date +%s) - t0) - 3))
  rest=$(($1 < rest ? $1 : rest))
  echo $((rest > 1 ? rest : 1))
}
may() { [ "$(cap 8)" -ge 8 ]; }
row() { rows+=("| $1 | $2 | $3 |"); }
unpack() {
  [ -d "$1" ] || tar -xJf "$1.tar.xz" -C "$(dirname "$1")"
  # shellcheck disable=SC1090
  source "$1/env.sh"
  echo "cores $(nproc); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
}
pack_carry() {
  local name=$1 tmp
  shift
  tmp=$(mktemp -d)
  tools/gpu/pack_binaries.sh "$tmp/$name" "$@" > /dev/null || return 1
  mkdir -p .device-carry
  (cd "$tmp" && XZ_OPT=-9 tar -cJf "$OLDPWD/.device-carry/$name.tar.xz" "$name") || return 1
  rm -rf "$tmp"
  ls -la ".device-carry/$name.tar.xz"
}
engine_suite() {
  (
    unpack ".device-carry/$1" > /dev/null
    local s
    s=$(date +%s)
    PDSERVE_SOURCE_DIR=$PWD timeout -k 5 "$(cap "${2:-120}")" engine_gpu_tests > "$out/engine.log" 2>&1
    echo "| engine tests | rc=$? | $(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/engine.log" | tr '\n' ' ') |"
    grep -E '^\[  FAILED  \]' "$out/engine.log" | head -10
  ) > "$out/engine.md"
  rows+=("$(head -1 "$out/engine.md")")
}
