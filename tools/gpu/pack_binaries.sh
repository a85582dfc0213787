#!/usr/bin/env bash
# Packs binaries built here with every shared library they need beyond libc / libstdc++ / the
# CUDA runtime libraries (cuBLAS, cudart: the GPU machine has its own), plus UCX's cma transport
# module, for a machine without this project's Debian packages (the device machine). Layout:
# <out>/bin/<name>, <out>/lib/*.so*, <out>/lib/ucx/; <out>/env.sh sets PATH, LD_LIBRARY_PATH and
# UCX_MODULE_DIR for them when sourced there (from any directory).
# Usage: tools/gpu/pack_binaries.sh <output dir> <binary>...
set -euo pipefail
out=$1
shift
[ $# -gt 0 ] || { echo "usage: $0 <output dir> <binary>..." >&2; exit 2; }
moddir=$(dirname "$(readlink -f "$(ldconfig -p | awk '/libucs.so.0 / {print $NF; exit}')")")/ucx
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib/ucx"
for b in "$@"; do
  [ -x "$b" ] || { echo "no executable $b" >&2; exit 1; }
  cp "$b" "$out/bin/"
done
# Only the shared-memory helper module: the InfiniBand ones need verbs libraries.
cp -L "$moddir"/libuct_cma.so.0 "$out/lib/ucx/"
for f in "$@" "$moddir"/libuct_cma.so.0; do ldd "$f"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux|libpthread|libdl|librt|libcublas(Lt)?|libcudart|libcuda|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
strip --strip-unneeded "$out"/lib/*.so* "$out"/lib/ucx/*.so* 2>/dev/null || true
strip "$out"/bin/* 2>/dev/null || true
cat > "$out/env.sh" <<'ENV'
pack_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
chmod +x "$pack_dir"/bin/*
export PATH=$pack_dir/bin:$PATH
cuda_libs=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$pack_dir/lib:$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$pack_dir/lib/ucx
ENV
du -sh "$out"
