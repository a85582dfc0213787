// Why a JSON text did not parse, for an error message a client can act on.
//
// nlohmann's parser answers a number that overflows a double (`1e400`, or 400 digits) with the
// same discarded value as broken grammar, although the text is valid JSON (RFC 8259 section 6
// leaves the range to the implementation): a request with `"max_tokens": 1e400` was told its
// body "is not valid JSON". FindJsonParseFailure parses the text once more, without building it,
// and says which of the two it was and where.
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace pdserve {

struct JsonParseFailure {
  // kNumberOutOfRange: the grammar is valid up to a number whose magnitude does not fit a double
  // (above about 1.8e308); kSyntax: anything else.
  enum class Kind { kSyntax, kNumberOutOfRange };
  Kind kind = Kind::kSyntax;
  // Bytes the parser had read when it stopped (nlohmann's chars_read_total): the 1-based position
  // of the byte that broke the grammar, or of a number's last byte; the text's size + 1 when the
  // text ended inside a value (the end counts as a byte read).
  size_t byte = 0;
  // Where the value that failed sits, as members and indices from the root: "max_tokens",
  // "messages[0].content", "" for the root itself (for a syntax error: where the parser was). Each
  // member name is cut to 64 bytes, the path to 256, so that a client's long key cannot make the
  // message long.
  std::string path;
  // The first member name of `path` (the request field, for an OpenAI error's `param`); "" when
  // the root is not an object. Cut to 64 bytes.
  std::string top_key;
  // The offending token as written, cut to 32 bytes ("..." then).
  std::string token;
};

// nullopt when `text` parses as JSON (nlohmann::json::parse, strict: nothing after the value).
// No recursion: the place is kept as one heap entry per open level, so a caller that checked the
// depth first (common/json_depth.h) bounds it.
std::optional<JsonParseFailure> FindJsonParseFailure(std::string_view text);

// "'<where>': the number <token> is out of range (a JSON number here must fit a double, at most
// about 1.8e308 in magnitude)", where <where> is `base` (the text's own place, "" for a request
// body) followed by failure.path; "request body: the number ..." when both are empty.
std::string NumberOutOfRangeMessage(std::string_view base, const JsonParseFailure& failure);

}  // namespace pdserve
