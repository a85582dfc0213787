#include "engine/state.h"

#include <algorithm>

namespace pdserve::engine {

void AppendRows(Tensor* t, const float* rows_data, int64_t rows) {
  const int64_t cols = t->shape.at(1);
  t->data.insert(t->data.end(), rows_data, rows_data + rows * cols);
  t->shape[0] += rows;
}

void DropFrontRows(Tensor* t, int64_t rows) {
  rows = std::clamp<int64_t>(rows, 0, t->shape.at(0));
  const int64_t cols = t->shape.at(1);
  t->data.erase(t->data.begin(), t->data.begin() + rows * cols);
  t->shape[0] -= rows;
}

}  // namespace pdserve::engine
