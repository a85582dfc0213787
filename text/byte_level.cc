#include "text/byte_level.h"

#include <array>

namespace pdserve::text {
namespace {

struct ByteLevelTables {
  std::array<std::string, 256> byte_to_char;
  // Indexed by code point; the largest mapped code point is U+0143.
  std::array<int16_t, 0x144> char_to_byte;

  ByteLevelTables() {
    char_to_byte.fill(-1);
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const int cp = printable ? b : 0x100 + next_extra++;
      byte_to_char[b] = EncodeCodePoint(cp);
      char_to_byte[cp] = static_cast<int16_t>(b);
    }
  }

  static std::string EncodeCodePoint(int cp) {
    if (cp < 0x80) return std::string(1, static_cast<char>(cp));
    return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables tables;
  return tables;
}

}  // namespace

std::string_view ByteLevelChar(uint8_t byte) { return Tables().byte_to_char[byte]; }

std::string ByteLevelEncode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out.append(ByteLevelChar(static_cast<uint8_t>(c)));
  return out;
}

bool ByteLevelDecode(std::string_view token, std::string* out) {
  const ByteLevelTables& tables = Tables();
  const size_t start = out->size();
  size_t pos = 0;
  while (pos < token.size()) {
    const auto lead = static_cast<uint8_t>(token[pos]);
    int cp = -1;
    if (lead < 0x80) {
      cp = lead;
      pos += 1;
    } else if ((lead & 0xE0) == 0xC0 && pos + 1 < token.size()) {
      cp = ((lead & 0x1F) << 6) | (static_cast<uint8_t>(token[pos + 1]) & 0x3F);
      pos += 2;
    }
    if (cp < 0 || cp >= static_cast<int>(tables.char_to_byte.size()) ||
        tables.char_to_byte[cp] < 0) {
      out->resize(start);
      return false;
    }
    out->push_back(static_cast<char>(tables.char_to_byte[cp]));
  }
  return true;
}

}  // namespace pdserve::text
