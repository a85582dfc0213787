// Fuzz entry points for the checkpoint parsers that read untrusted bytes. Each libFuzzer binary
// (*_fuzzer.cc, clang only) forwards LLVMFuzzerTestOneInput to one of these; the
// fuzz_smoke_test replays deterministic mutations through them in every build. They abort on a
// broken invariant and otherwise return 0.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pdserve::engine::testing {

// ParseSafetensors on a whole file image: what it accepts must lie inside the input.
int FuzzSafetensorsHeader(const uint8_t* data, size_t size);
// ModelConfig::Parse on config.json text: what it accepts must be internally consistent.
int FuzzModelConfig(const uint8_t* data, size_t size);

}  // namespace pdserve::engine::testing
