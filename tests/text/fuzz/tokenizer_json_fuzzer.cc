// Fuzzes the tokenizer.json parser: arbitrary bytes must load or fail with a Status, never crash;
// a tokenizer that loads must encode and decode a sample without crashing.
#include <cstdint>
#include <string_view>

#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  auto tokenizer = pdserve::text::Tokenizer::FromJson(json);
  if (!tokenizer.ok()) return 0;
  auto ids = (*tokenizer)->Encode("Hello 世界 <｜User｜> 123", {.allow_special = true});
  if (ids.ok()) (void)(*tokenizer)->Decode(*ids, true);
  return 0;
}
