// Walks a grammar's shortest completion byte by byte, for the tests of constrained decoding.
#pragma once

#include <cstdint>
#include <string>

#include "structured/byte_grammar.h"

namespace pdserve::structured::testing {

// Advances `m` along its shortest completion, one byte at a time (each step takes the lowest
// byte that shortens the completion by one). Returns the bytes taken; `m` is complete unless no
// byte shortened it somewhere (then `m` stays where the walk stopped).
inline std::string WalkShortestCompletion(GrammarMatcher& m) {
  std::string out;
  for (int64_t need = m.MinCompletionBytes(); need > 0; --need) {
    bool moved = false;
    for (int byte = 0; byte < 256 && !moved; ++byte) {
      GrammarMatcher next = m;
      if (next.Advance(static_cast<uint8_t>(byte)) && next.MinCompletionBytes() == need - 1) {
        m = next;
        out.push_back(static_cast<char>(byte));
        moved = true;
      }
    }
    if (!moved) break;
  }
  return out;
}

}  // namespace pdserve::structured::testing
