// pdserve's version, written in this one place: every process's pdserve_build_info{version=...}
// (metrics::AddBuildInfo, docs/metrics.md) reads it.
#pragma once

namespace pdserve {

inline constexpr char kVersion[] = "0.1.0";

}  // namespace pdserve
