#!/usr/bin/env bash
# The device tool copies the working tree (tracked files) plus `carry` paths, 64 MiB in all; with
# both bundled models the tracked files alone are ~100 MB. This script makes one device call's
# tree fit and puts it back afterwards (how the 2026-12-04 runs were made):
#
#   tools/gpu/device_tree.sh bundle [build]   # .device-carry/bundle.tar.xz: pdserve (+ EXTRA_BINS) + libs,
#                                             # engine_gpu_tests, sampler_gpu_tests (~17 MB)
#   tools/gpu/device_tree.sh tests            # move aside models/kjv-v4-wide and the fixtures
#                                             # the GPU tests do not read (tree ~42 MB)
#   tools/gpu/device_tree.sh wide             # move aside kjv-v4-tiny and tests/fixtures but
#                                             # small_model and v4_configs; carry
#                                             # kjv-v4-wide as .device-carry/wide.tar.xz (36 MB)
#   tools/gpu/device_tree.sh restore          # put everything back (always run it after the call)
#
# There, first: `mkdir -p .device-carry && tar -xJf .device-carry/bundle.tar.xz -C .device-carry
# && (cd .device-carry/bin && XZ_OPT="-0 -T0" tar -cJf ../gpu/libs.tar.xz lib)` (and, for `wide`,
# `tar -xJf .device-carry/wide.tar.xz`), then e.g. tools/gpu/run_wide_model_proof.sh.
# STASH (default ../.pdserve-device-stash, beside the checkout) holds what was moved aside.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
stash=${STASH:-$(cd .. && pwd)/.pdserve-device-stash}
mode=${1:?usage: $0 bundle [build] | tests | wide | restore}
aside() {  # paths relative to the repository root
  mkdir -p "$stash"
  for p in "$@"; do
    [ -e "$p" ] || continue
    [ ! -e "$stash/$p" ] || { echo "$stash/$p exists: run '$0 restore' first" >&2; exit 1; }
    mkdir -p "$stash/$(dirname "$p")" && mv "$p" "$stash/$p"
    echo "$p" >> "$stash/MOVED"
  done
}
case $mode in
  bundle)
    build=${2:-build}
    tmp=$(mktemp -d)
    mkdir -p "$tmp/gpu/bin" .device-carry
    cp "$build"/tests/engine_gpu/engine_gpu_tests "$build"/tests/engine_gpu/sampler_gpu_tests \
      "$tmp/gpu/bin/" && strip "$tmp"/gpu/bin/*
    # shellcheck disable=SC2086  # EXTRA_BINS: more binaries for bin/ (benches), space-separated
    tools/gpu/pack_binaries.sh "$tmp/bin" "$build/pdserve" ${EXTRA_BINS:-} > /dev/null
    (cd "$tmp" && tar -cf - gpu bin | xz -9 -T0) > .device-carry/bundle.tar.xz
    rm -rf "$tmp"
    ls -la .device-carry/bundle.tar.xz
    ;;
  tests)
    aside models/kjv-v4-wide tests/fixtures/wide_model tests/fixtures/text
    ;;
  wide)
    mkdir -p .device-carry
    tar -cf - models/kjv-v4-wide | xz -6 -T0 > .device-carry/wide.tar.xz
    # tests/fixtures/small_model stays (its prompt ids serve the wide model's GPU tests too), and
    # v4_configs (the V4-Flash config the benches read).
    aside models/kjv-v4-tiny models/kjv-v4-wide $(find tests/fixtures -mindepth 1 -maxdepth 1 \
      -not -name small_model -not -name v4_configs | sort)
    ;;
  restore)
    [ -d "$stash" ] || { echo "nothing aside in $stash"; exit 0; }
    while read -r p; do
      if [ -e "$p" ]; then echo "$p is back already; leaving $stash/$p" >&2; continue; fi
      mkdir -p "$(dirname "$p")" && mv "$stash/$p" "$p"
    done < "$stash/MOVED"
    rm -f "$stash/MOVED"
    find "$stash" -depth -type d -empty -delete
    git status --short -- models tests/fixtures | head
    ;;
  *) echo "usage: $0 bundle [build] | tests | wide | restore" >&2; exit 2 ;;
esac
echo "tracked files now: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
