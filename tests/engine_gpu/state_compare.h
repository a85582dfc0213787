// Bitwise comparison of CPU-layout decode states (engine/state.h) for the CUDA engine's state
// tests: every tensor of a state named in a fixed order, and exact equality of shapes and bits.
#pragma once

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "engine/state.h"

namespace pdserve::engine::gpu {

// Every tensor of one layer's state, named "<prefix>field", in a fixed order.
inline void AppendLayerFields(const LayerState& ls, const std::string& prefix,
                              std::vector<std::pair<std::string, const Tensor*>>* out) {
  out->push_back({prefix + "window_kv", &ls.window_kv});
  for (auto [name, c] : {std::pair{"compressor.", &ls.compressor}, {"indexer.", &ls.indexer}}) {
    out->push_back({prefix + name + "buffer_kv", &c->buffer_kv});
    out->push_back({prefix + name + "buffer_gate", &c->buffer_gate});
    out->push_back({prefix + name + "overlap_kv", &c->overlap_kv});
    out->push_back({prefix + name + "overlap_gate", &c->overlap_gate});
    out->push_back({prefix + name + "entries", &c->entries});
  }
}

// Every tensor of a state, named, in a fixed order.
inline std::vector<std::pair<std::string, const Tensor*>> Fields(const ModelState& s) {
  std::vector<std::pair<std::string, const Tensor*>> out;
  for (size_t l = 0; l < s.layers.size(); ++l) {
    AppendLayerFields(s.layers[l], "layer " + std::to_string(l) + " ", &out);
  }
  return out;
}

inline bool SameTensorBits(const Tensor& x, const Tensor& y) {
  return x.shape == y.shape &&
         std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)) == 0;
}

// The name of the first field of `a` that differs from `b` in shape or bits; empty when equal.
inline std::string FirstDifference(const LayerState& a, const LayerState& b) {
  std::vector<std::pair<std::string, const Tensor*>> fa;
  std::vector<std::pair<std::string, const Tensor*>> fb;
  AppendLayerFields(a, "", &fa);
  AppendLayerFields(b, "", &fb);
  for (size_t i = 0; i < fa.size(); ++i) {
    if (!SameTensorBits(*fa[i].second, *fb[i].second)) return fa[i].first;
  }
  return "";
}

inline bool SameState(const ModelState& a, const ModelState& b) {
  if (a.position != b.position || a.layers.size() != b.layers.size()) return false;
  for (size_t l = 0; l < a.layers.size(); ++l) {
    if (!FirstDifference(a.layers[l], b.layers[l]).empty()) return false;
  }
  return true;
}

}  // namespace pdserve::engine::gpu
