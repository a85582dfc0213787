// libFuzzer binary for the config.json parser (clang: -fsanitize=fuzzer).
#include "tests/engine_loader/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return pdserve::engine::testing::FuzzModelConfig(data, size);
}
