#include "engine/fp8_emulation.h"

#include <vector>

#include "engine/quant.h"
#include "kernels/cpu/fp8_gemm.h"
#include "kernels/cpu/gemm.h"

namespace pdserve::engine {

void EmulatedLinear(const Fp8Emulation& emulation, const float* x, int64_t rows, int64_t in,
                    int64_t x_stride, const float* w, int64_t out, float* y, int64_t y_stride) {
  namespace cpu = kernels::cpu;
  if (!emulation.on() || in % cpu::kQuantBlock != 0 || rows == 0) {
    cpu::Linear(x, rows, in, x_stride, w, out, y, y_stride);
    return;
  }
  std::vector<float> xq(static_cast<size_t>(rows * in));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < in; ++c) xq[r * in + c] = x[r * x_stride + c];
  }
  if (emulation.bf16_inputs || emulation.quantize_inputs) RoundToBf16(xq.data(), rows * in);
  if (emulation.quantize_inputs) {
    std::vector<uint8_t> codes(xq.size());
    std::vector<float> scales(static_cast<size_t>(rows * (in / cpu::kQuantBlock)));
    cpu::QuantizeActivations(xq.data(), rows, in, in, emulation.ue8m0_scales, codes.data(),
                             scales.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < in; ++c) {
        xq[r * in + c] =
            cpu::E4m3Value(codes[r * in + c]) * scales[(c / cpu::kQuantBlock) * rows + r];
      }
    }
  }
  cpu::Linear(xq.data(), rows, in, in, w, out, y, y_stride);
  if (emulation.bf16_outputs) {
    for (int64_t r = 0; r < rows; ++r) RoundToBf16(y + r * y_stride, out);
  }
}

}  // namespace pdserve::engine
