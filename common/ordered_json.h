// Parsing untrusted JSON text into nlohmann::ordered_json in time linear in the text.
//
// nlohmann::ordered_json::parse inserts each object member through ordered_map::operator[],
// which searches the members already there: an object of n members costs O(n^2) compares (a
// 350k-member object took 80 s in the router, breaker report 2026-12-04). ParseOrderedJson builds
// the same value with a SAX handler that keeps a hash index of each open object's keys.
#pragma once

#include <string_view>

#include "nlohmann/json.hpp"

namespace pdserve {

// The value of `text` as nlohmann::ordered_json::parse(text, nullptr, false) gives it: members in
// the order written; a repeated key keeps its first position and takes its last value; a value of
// type discarded where `text` is not one complete JSON value. Linear in text.size() (expected,
// hashing). Recursion: none while parsing, but destroying or copying the result recurses once per
// nesting level, so callers bound the depth first (common/json_depth.h). Thread-safe (no shared
// state).
nlohmann::ordered_json ParseOrderedJson(std::string_view text);

}  // namespace pdserve
