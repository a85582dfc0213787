// Fuzzes Encode/Decode/streaming with untrusted text on the fixture tokenizer. Properties:
// invalid UTF-8 is rejected; Decode(Encode(text)) == text with special tokens plain or matched;
// streaming the ids with a stop string equals the non-streamed text cut at that stop string.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "text/incremental_detokenizer.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace {

const pdserve::text::Tokenizer& Fixture() {
  static const auto* tokenizer =
      pdserve::text::Tokenizer::Load(PDSERVE_TEXT_FIXTURES "/deepseek_like")->release();
  return *tokenizer;
}

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdserve::text;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const Tokenizer& tok = Fixture();
  for (bool allow_special : {false, true}) {
    auto ids = tok.Encode(text, {.add_special_tokens = false, .allow_special = allow_special});
    Check(ids.ok() == IsValidUtf8(text));
    if (!ids.ok()) return 0;
    Check(*tok.Decode(*ids, false) == text);
  }
  const auto ids = *tok.Encode(text, {.add_special_tokens = false});
  DetokenizeOptions options{.skip_special_tokens = false, .stop_strings = {}};
  if (size >= 2) options.stop_strings.push_back(Utf8Lossy(text.substr(size / 2, 2)));
  IncrementalDetokenizer detok(tok, options);
  std::string streamed;
  for (int32_t id : ids) streamed += detok.Add(id)->text;
  streamed += detok.Finish().text;
  Check(streamed == TruncateAtStop(*tok.Decode(ids, false), options.stop_strings));
  return 0;
}
