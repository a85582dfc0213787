// The GPT-2 byte <-> printable-character map used by byte-level BPE vocabularies.
//
// Every byte 0..255 maps to one Unicode code point: printable Latin-1 bytes ('!'..'~', U+00A1..
// U+00AC, U+00AE..U+00FF) map to themselves, the other 68 to U+0100 + n in byte order. This is the
// map of OpenAI's GPT-2 encoder.py `bytes_to_unicode` and of `tokenizers`' ByteLevel.
//
// Thread-safety: immutable after static initialization.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pdserve::text {

// The UTF-8 text of the vocabulary character standing for `byte`.
std::string_view ByteLevelChar(uint8_t byte);

// Maps raw bytes to their vocabulary characters (UTF-8).
std::string ByteLevelEncode(std::string_view bytes);

// Appends the raw bytes that the vocabulary string `token` stands for. Returns false, appending
// nothing, when some character of `token` is not in the map (e.g. an added token such as
// "<｜User｜>"), in which case the ByteLevel decoder uses the token's own UTF-8 bytes.
bool ByteLevelDecode(std::string_view token, std::string* out);

}  // namespace pdserve::text
