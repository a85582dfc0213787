#!/usr/bin/env bash
# The main job (`make demo`). Until the cluster exists it runs the engine on the bundled model.
set -euo pipefail
build=${1:-build}
echo "demo: the cluster does not exist yet; see README.md" >&2
"$build/pdserve" --help
