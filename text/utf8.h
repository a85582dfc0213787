// UTF-8 helpers with the exact semantics of Rust's String::from_utf8_lossy, which the Hugging Face
// `tokenizers` ByteLevel decoder applies; matching them is what makes decode() byte-identical.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace pdserve::text {

// The outcome of reading one UTF-8 sequence at the start of `bytes` (non-empty).
struct Utf8Step {
  enum class Kind {
    kValid,       // `length` bytes form one scalar value.
    kInvalid,     // `length` bytes (a maximal valid-prefix subpart, >= 1) are invalid.
    kIncomplete,  // all of `bytes` (`length` == size) is a valid prefix cut short by the end.
  };
  Kind kind;
  size_t length;
};

// Reads one sequence following the Unicode "maximal subpart" rule (Unicode 15, section 3.9,
// U+FFFD substitution), as Rust's core::str::Utf8Chunks does. REQUIRES: !bytes.empty().
Utf8Step ReadUtf8(std::string_view bytes);

// Decodes `bytes`, replacing each maximal invalid subpart (and a truncated final sequence) by one
// U+FFFD. Equal to Rust's String::from_utf8_lossy.
std::string Utf8Lossy(std::string_view bytes);

// True when `bytes` is well-formed UTF-8.
bool IsValidUtf8(std::string_view bytes);

// Length of the trailing bytes of `bytes` that are a valid but unfinished UTF-8 sequence (0..3).
// Everything before them decodes the same whatever bytes follow.
size_t IncompleteUtf8Tail(std::string_view bytes);

}  // namespace pdserve::text
