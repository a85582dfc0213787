// How deep untrusted JSON text may nest, checked on the text before anything parses it.
//
// nlohmann's parser and destructor are iterative, but copying a value, comparing two, dumping one
// and pdserve's own walkers (text/python_json.cc) recurse once per level, and an ordered_json
// object copies its members when it grows: a 2 MB document of nested arrays overflowed the stack
// of the thread that held it (router, `pdserve serve` and the workers died with SIGSEGV, found by
// a breaker, 2026-12-04). Every DOM parse of JSON that came from outside the process (an HTTP
// body, a JSON document inside a string field of an HTTP body or a gRPC message, the worker RPCs'
// schema and grammar texts) is preceded by CheckJsonDepth; docs/api.md states the limit.
//
// Pure functions; thread-safe.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdserve {

// The most arrays and objects a JSON text may have open at once. Deeper than any schema pdserve
// compiles (structured::JsonSchema refuses schemas nesting deeper than 24 schema levels, each at
// most a few JSON levels) or any request body that wraps one.
inline constexpr int kMaxJsonDepth = 256;

// Whether `text` opens more than `limit` arrays and objects at once. One pass over the bytes
// without recursion or allocation: '[' and '{' open a level and ']' and '}' close one, except
// inside strings (a '"' outside a string opens one; inside, a backslash escapes the next byte and
// an unescaped '"' ends it). Exact for valid JSON; on other text it only counts, and the parse that
// follows refuses the text. A scalar is at depth 0: "1" and "[]" both pass a limit of 1, "[[]]"
// does not.
bool JsonNestsDeeperThan(std::string_view text, int limit);

// OK when `text` nests at most kMaxJsonDepth arrays and objects; else InvalidArgument
// "<what> nests deeper than 256 JSON levels" (a level is an array or an object). `what` names the
// text for the client ("request body", "tools[0].function.parameters").
absl::Status CheckJsonDepth(std::string_view text, absl::string_view what);

}  // namespace pdserve
