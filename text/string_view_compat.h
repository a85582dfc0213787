// Debian 12's Abseil is built without std::string_view aliasing, so absl::string_view is its own
// type and heterogeneous lookups in absl hash containers need one. Thread-safety: pure.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace pdserve::text {

inline absl::string_view AbslView(std::string_view s) { return {s.data(), s.size()}; }

}  // namespace pdserve::text
