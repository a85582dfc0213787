#!/usr/bin/env bash
# Installs every build and test dependency of pdserve from Debian 12 packages (apt) and the
# Python test tooling from PyPI (pip, into a virtual environment of the project's own,
# $stamp_dir/venv, which the build's Python tests run with). Idempotent: a second run only checks
# and returns. Nothing here is fetched during the build itself.
#
# The stamp file is written only when everything succeeded, so a failed run is tried again.
# A pip failure fails this script, unless PDSERVE_PIP_OPTIONAL=1: then it only warns, the Python
# tests that need those packages show as skipped in ctest, and no stamp is written.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git curl ca-certificates
  python3 python3-venv python3-numpy
  libopenblas-dev
  nlohmann-json3-dev libyaml-cpp-dev libspdlog-dev libfmt-dev libcli11-dev
  libxxhash-dev libpcre2-dev libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libboost-dev libboost-system-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libucx-dev ucx-utils
  libsystemd-dev systemd
  prometheus-cpp-dev
  prometheus
  bible-kjv-text bible-kjv
  clang-format
)
# Python test tooling Debian 12 does not package (numpy is python3-numpy above), pinned to the
# versions the tests were run with; and the modules that must import in the venv afterwards.
# openai-agents: the agent-style client of the tool round trip (tests/structured/
# tool_call_roundtrip_test.py).
PIP_PACKAGES=(tokenizers==0.23.3 safetensors==0.8.0 openai==3.57.0 jsonschema==4.26.0
  grpcio==1.85.1 grpcio-reflection==1.85.1 grpcio-health-checking==1.85.1 openai-agents==0.24.0)
PY_MODULES="numpy tokenizers safetensors openai jsonschema grpc grpc_reflection grpc_health agents"

stamp_dir="${PDSERVE_DEPS_STAMP_DIR:-/var/lib/pdserve}"
# CMakeLists.txt looks for the venv here too (PDSERVE_TEST_VENV).
venv="$stamp_dir/venv"
stamp="$stamp_dir/deps-$(printf '%s ' "${APT_PACKAGES[@]}" "${PIP_PACKAGES[@]}" "$PY_MODULES" |
  md5sum | cut -c1-12)"

if [ -f "$stamp" ] && [ -x "$venv/bin/python3" ]; then
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

# Python test tooling (fixture cross-checks, the openai client), in the project's venv. The stamp
# dir (and so the venv) is the caller's where the caller may write there, root's otherwise.
mkdir -p "$stamp_dir" 2>/dev/null || "${sudo_cmd[@]}" mkdir -p "$stamp_dir"
as_owner=()
if [ ! -w "$stamp_dir" ]; then as_owner=("${sudo_cmd[@]}"); fi
here=$(cd "$(dirname "$0")" && pwd)
if ! "${as_owner[@]}" "$here/make-test-venv.sh" "$venv" "$PY_MODULES" "${PIP_PACKAGES[@]}"; then
  if [ "${PDSERVE_PIP_OPTIONAL:-0}" = 1 ]; then
    echo "install-deps: WARNING: the Python test venv $venv is not ready (see above);" \
      "PDSERVE_PIP_OPTIONAL=1, so going on: the Python tests that need it show as skipped," \
      "and the next run tries again" >&2
    exit 0
  fi
  echo "install-deps: ERROR: could not make the Python test venv $venv (see above)." >&2
  echo "install-deps: it needs PyPI; set PDSERVE_PIP_OPTIONAL=1 to go on without it" \
    "(the Python tests that need it then show as skipped)." >&2
  exit 1
fi

"${as_owner[@]}" touch "$stamp"
