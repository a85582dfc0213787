#include "tests/engine_loader/fuzz_targets.h"

#include <cstdlib>
#include <span>
#include <string>

#include "engine/config.h"
#include "engine/safetensors.h"

namespace pdserve::engine::testing {

int FuzzSafetensorsHeader(const uint8_t* data, size_t size) {
  auto layout = ParseSafetensors(std::span<const uint8_t>(data, size), "fuzz");
  if (!layout.ok()) return 0;
  if (layout->data_offset > size) std::abort();
  const uint64_t data_size = size - layout->data_offset;
  for (const TensorInfo& t : layout->tensors) {
    if (t.begin > t.end || t.end > data_size || t.NumElements() < 0) std::abort();
  }
  return 0;
}

int FuzzModelConfig(const uint8_t* data, size_t size) {
  auto config =
      ModelConfig::Parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
  if (!config.ok()) return 0;
  const auto n = static_cast<size_t>(config->num_hidden_layers);
  if (config->layer_types.size() != n || config->mlp_layer_types.size() != n) std::abort();
  if (config->hidden_size <= 0 || config->n_routed_experts <= 0) std::abort();
  return 0;
}

}  // namespace pdserve::engine::testing
