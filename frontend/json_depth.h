// How deep a client's JSON document (a response_format schema, a tool's parameters) may nest
// before a front copies or re-serializes it.
//
// Pure functions; thread-safe.
#pragma once

#include <utility>
#include <vector>

namespace pdserve::frontend {

// Deeper JSON than any schema pdserve compiles (structured::JsonSchema refuses schemas nesting
// deeper than 24 levels, each at most a few JSON levels). A front checks a schema against it
// before copying or re-serializing it, both of which recurse once per level: a 2 MB document of
// nested arrays would otherwise overflow the stack of the thread that reads it.
inline constexpr int kMaxJsonDepth = 256;

// Whether `value` (nlohmann::json or ordered_json) nests deeper than `limit` levels (a scalar is
// one level), found without recursion.
template <typename Json>
bool DeeperThan(const Json& value, int limit) {
  std::vector<std::pair<const Json*, int>> stack = {{&value, 1}};
  while (!stack.empty()) {
    auto [node, depth] = stack.back();
    stack.pop_back();
    if (depth > limit) return true;
    if (node->is_structured()) {
      for (const Json& child : *node) stack.emplace_back(&child, depth + 1);
    }
  }
  return false;
}

}  // namespace pdserve::frontend
