// A dense, row-major float32 tensor owned by value: the CPU engine's unit of weights and
// activations. Shapes are int64 dims, outermost first ([rows, cols] for a Linear weight, as in
// PyTorch: [out_features, in_features]). Not thread-safe for concurrent mutation; concurrent
// reads are fine.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace pdserve::engine {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> dims)
      : shape(std::move(dims)), data(static_cast<size_t>(NumElements(shape)), 0.0f) {}

  static int64_t NumElements(const std::vector<int64_t>& dims) {
    return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
  }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim(size_t i) const { return shape.at(i); }
  size_t rank() const { return shape.size(); }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  // "[4, 64]" — for error messages.
  std::string ShapeString() const {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ", ";
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }
};

}  // namespace pdserve::engine
