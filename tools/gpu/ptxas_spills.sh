#!/usr/bin/env bash
# Registers and spills of every kernel in some CUDA sources of kernels/cuda, from ptxas -v, here
# (no GPU needed): the same nvcc command line as the build's, with -Xptxas -v added and the
# object written to a scratch file (the build's own object is left alone).
#
#   tools/gpu/ptxas_spills.sh [-b BUILD_DIR] [-f FILTER] SOURCE...
#     SOURCE: a file name under kernels/cuda without .cu (e.g. topk, sparse_decode_attention)
#     -b: the configured build directory (default build); -f: an extended regex on the demangled
#     kernel name (default: every kernel)
#
# Prints one line per kernel: registers, spill stores / loads (bytes), stack frame, name. Why:
# code generation moves these between builds of the same code path (the top-k at 1024 threads has
# 64 registers a thread), and a timing A/B of a kernel change reads them beside its figures
# (docs/perf.md, issue 30, 2026-12-06: 12 / 24 bytes on main 8e07771, 24 / 60 on branch topk75,
# 0 since each chunk's vectors are reloaded in place).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=build
filter=.
while getopts "b:f:" opt; do
  case $opt in
    b) build=$OPTARG ;;
    f) filter=$OPTARG ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { sed -n '2,12p' "$0"; exit 2; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for source in "$@"; do
  target=kernels/cuda/CMakeFiles/pdserve_kernels_cuda.dir/$source.cu.o
  cmd=$(cd "$build" && ninja -t commands "$target" | tail -1)
  [ -n "$cmd" ] || { echo "$source: no build command for $target in $build" >&2; exit 1; }
  # The build's command, with ptxas -v and the scratch object.
  cmd=${cmd/ -c / -Xptxas -v -c }
  (cd "$build" && eval "$cmd -o $scratch/$source.o") > "$scratch/$source.log" 2>&1 || {
    cat "$scratch/$source.log" >&2
    exit 1
  }
  echo "== $source"
  # ptxas prints, per kernel: "Compiling entry function '<mangled>'", then the stack frame and
  # spill line, then "Used N registers".
  awk -v filter="$filter" '
    /Compiling entry function/ { match($0, /_Z[A-Za-z0-9_]+/); name = substr($0, RSTART, RLENGTH) }
    /bytes stack frame/ { frame = $1; stores = $5; loads = $9 }
    /Used [0-9]+ registers/ && name != "" {
      regs = $5
      cmd = "c++filt " name
      cmd | getline demangled
      close(cmd)
      if (demangled ~ filter) {
        printf "%4s registers  %5s / %-5s bytes spilled  %4s frame  %s\n", regs, stores, loads, frame, demangled
      }
      name = ""
    }' "$scratch/$source.log"
done
