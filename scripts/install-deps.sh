#!/usr/bin/env bash
# Installs every build and test dependency of pdserve from Debian 12 packages (apt) and the
# Python test tooling from PyPI (pip). Idempotent: a second run only checks and returns.
# Nothing here is fetched during the build itself.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git curl python3
  libopenblas-dev
  nlohmann-json3-dev libyaml-cpp-dev libspdlog-dev libfmt-dev libcli11-dev
  libxxhash-dev libpcre2-dev libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libboost-dev libboost-system-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev ucx-utils
  libsystemd-dev systemd
  prometheus
  bible-kjv-text bible-kjv
  clang-format
)
PIP_PACKAGES=(numpy tokenizers safetensors openai)

stamp_dir="${PDSERVE_DEPS_STAMP_DIR:-/var/lib/pdserve}"
stamp="$stamp_dir/deps-$(printf '%s ' "${APT_PACKAGES[@]}" "${PIP_PACKAGES[@]}" | md5sum | cut -c1-12)"

if [ -f "$stamp" ]; then
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# Python test tooling only (fixture cross-checks, the openai client). Tests that need it skip
# with a clear message where pip cannot reach PyPI.
py=$(command -v python3)
if ! "$py" -c 'import numpy, tokenizers, safetensors, openai' 2>/dev/null; then
  echo "install-deps: pip install ${PIP_PACKAGES[*]}"
  "$py" -m pip install -q "${PIP_PACKAGES[@]}" || echo "install-deps: pip failed; Python-based tests will skip"
fi

"${sudo_cmd[@]}" mkdir -p "$stamp_dir"
"${sudo_cmd[@]}" touch "$stamp"
