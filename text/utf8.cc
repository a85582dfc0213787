#include "text/utf8.h"

#include <cstdint>

namespace pdserve::text {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

bool IsContinuation(uint8_t b) { return (b & 0xC0) == 0x80; }

// Valid range of the second byte after lead byte `lead` (Unicode Table 3-7).
bool SecondByteOk(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0:
      return b >= 0xA0 && b <= 0xBF;
    case 0xED:
      return b >= 0x80 && b <= 0x9F;
    case 0xF0:
      return b >= 0x90 && b <= 0xBF;
    case 0xF4:
      return b >= 0x80 && b <= 0x8F;
    default:
      return IsContinuation(b);
  }
}

size_t SequenceWidth(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

}  // namespace

Utf8Step ReadUtf8(std::string_view bytes) {
  const auto lead = static_cast<uint8_t>(bytes[0]);
  const size_t width = SequenceWidth(lead);
  if (width == 0) return {Utf8Step::Kind::kInvalid, 1};
  for (size_t i = 1; i < width; ++i) {
    if (i == bytes.size()) return {Utf8Step::Kind::kIncomplete, i};
    const auto b = static_cast<uint8_t>(bytes[i]);
    const bool ok = i == 1 ? SecondByteOk(lead, b) : IsContinuation(b);
    if (!ok) return {Utf8Step::Kind::kInvalid, i};
  }
  return {Utf8Step::Kind::kValid, width};
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const Utf8Step step = ReadUtf8(bytes.substr(pos));
    if (step.kind == Utf8Step::Kind::kValid) {
      out.append(bytes.substr(pos, step.length));
    } else {
      out.append(kReplacement);
    }
    pos += step.length;
  }
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Utf8Step step = ReadUtf8(bytes.substr(pos));
    if (step.kind != Utf8Step::Kind::kValid) return false;
    pos += step.length;
  }
  return true;
}

size_t IncompleteUtf8Tail(std::string_view bytes) {
  // A sequence is at most 4 bytes, so only a lead byte within the last 3 can be unfinished.
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<uint8_t>(bytes[n - back]);
    if (IsContinuation(b)) continue;
    const Utf8Step step = ReadUtf8(bytes.substr(n - back));
    return step.kind == Utf8Step::Kind::kIncomplete ? back : 0;
  }
  return 0;
}

}  // namespace pdserve::text
