#!/usr/bin/env bash
# Benchmarks (`make bench`): CPU engine prefill / decode throughput. Record results in docs/perf.md.
set -euo pipefail
build=${1:-build}
"$build/bench/engine/engine_bench" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
