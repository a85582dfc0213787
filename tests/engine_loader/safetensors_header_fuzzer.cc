// libFuzzer entry point for the safetensors header parser (untrusted bytes: a checkpoint file).
// Built as its own binary with clang (-fsanitize=fuzzer); also linked into engine_loader_test,
// where header_fuzz_smoke_test.cc replays seeds and deterministic mutations through it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto layout = pdserve::engine::ParseSafetensors(std::span<const uint8_t>(data, size), "fuzz");
  if (!layout.ok()) return 0;
  // Whatever the parser accepts must lie inside the input.
  if (layout->data_offset > size) std::abort();
  const uint64_t data_size = size - layout->data_offset;
  for (const auto& t : layout->tensors) {
    if (t.begin > t.end || t.end > data_size) std::abort();
    if (t.NumElements() < 0) std::abort();
  }
  return 0;
}
