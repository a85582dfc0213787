// Times the act-quant kernels (kernels/cuda/act_quant.cuh) alone, each beside the floor of the
// same bytes read and written, and the W8A8 GEMM with and without its act quant (fp8_gemm,
// fp8_gemm_quantized: kernels/cuda/fp8_gemm.cuh) at V4-Flash's dense shapes (bench_util.cuh) and
// prefill token counts, in CUDA graphs of kLayers layers (each layer its own input, outputs and
// weights; GraphMicros: median of 20 replays / kLayers). Prints CSV rows
//   kernel,shape,tokens,median_us,bytes,flops
// kernel: act_quant_warp / act_quant_vec (act_quant, bf16 in: ActQuantVariant kWarpPerBlock /
// kHalfWarpVectorized), act_quant_f32 (act_quant_f32, fp32 in, no bf16 copy), swiglu_quant (w2's
// input only: clamped_swiglu_act_quant from fp32 [gate | up]); bytes = bytes read + written.
// Besides the four GEMM shapes, "wo_a": the attention output [m, 32768] at 512 and 2048 tokens,
// act_quant_f32 in o_a's 8 column groups of 4096 (the engine's fp8_shared_act_quant).
// <kernel>_read: RwFloor over the same bytes read and written (no math: the floor of a kernel
// that must move them). fp8_gemm (act quant by the process's variant, PDSERVE_ACT_QUANT, then the
// GEMM as fp8_gemm dispatches: cuBLASLt at these sizes) and fp8_quantized (fp8_gemm_quantized on
// activations quantized beforehand: the GEMM alone, what torch._scaled_mm times); bytes = weight
// and scale bytes, flops = 2 m n k. shape: the GEMM whose input it is (k = its reduction).
// Optional argument "quant" or "gemm": only those rows. tools/gpu/run_actq25.sh runs it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/cuda/bench_util.cuh"
#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/fp8_gemm.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kLayers = 16;
const std::vector<int64_t> kTokens = {512, 4096, 8192};
constexpr int64_t kMaxTokens = 8192;
constexpr int64_t kMaxK = 8192;

// Reads n_in and writes n_out 16-byte units, four loads in flight per thread, each store
// depending on the loads before it (so neither is optimized away).
__global__ void __launch_bounds__(512)
    RwFloor(const uint4* __restrict__ in, size_t n_in, uint4* __restrict__ out, size_t n_out) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  const size_t n = n_in > n_out ? n_in : n_out;
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += 4 * stride) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t at = i + j * stride;
      if (at < n_in) {
        const uint4 v = in[at];
        x ^= v.x ^ v.w;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t at = i + j * stride;
      if (at < n_out) out[at] = make_uint4(x, x + 1, x + 2, x + 3);
    }
  }
}

void PrintRow(const std::string& kernel, const char* shape, int64_t tokens, double us, double bytes,
              double flops) {
  std::printf("%s,%s,%lld,%.3f,%.0f,%.0f\n", kernel.c_str(), shape, static_cast<long long>(tokens),
              us, bytes, flops);
  std::fflush(stdout);
}

// Per layer: the inputs (bf16, fp32 and fp32 [gate | up], each at the largest size) and outputs.
struct Buffers {
  std::vector<__nv_bfloat16*> x;
  std::vector<float*> x32;
  std::vector<uint8_t*> xq;
  std::vector<float*> xs;
};

Buffers Allocate() {
  Buffers b;
  const size_t elements = static_cast<size_t>(kMaxTokens * kMaxK);
  for (int l = 0; l < kLayers; ++l) {
    auto* x = DeviceAlloc<uint16_t>(elements);
    FillBf16(x, elements, 101u + l);
    b.x.push_back(reinterpret_cast<__nv_bfloat16*>(x));
    // fp32 inputs: the bf16 bits widened would do, but any finite values serve for timing.
    float* x32 = DeviceAlloc<float>(elements);
    FillScales<<<1024, 256>>>(x32, nullptr, elements, 7u + l);
    BENCH_CHECK(cudaGetLastError());
    b.x32.push_back(x32);
    // Room for RwFloor's writes too: the e4m3 bytes and the scales' bytes after them.
    b.xq.push_back(DeviceAlloc<uint8_t>(elements + elements / kActQuantBlock * sizeof(float)));
    b.xs.push_back(DeviceAlloc<float>(elements / kActQuantBlock));
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  return b;
}

// One kernel's row and its floor's: `in_bytes` read from layer l's input `in(l)`.
void TimeWithFloor(const std::string& name, const char* shape, int64_t m, size_t in_bytes,
                   size_t out_bytes, const std::function<const void*(int)>& in,
                   const std::function<void(int)>& launch, const Buffers& b, int sms,
                   cudaStream_t stream) {
  const double us = GraphMicros(launch, kLayers, 20, stream);
  PrintRow(name, shape, m, us, static_cast<double>(in_bytes + out_bytes), 0);
  const size_t units = std::max(in_bytes, out_bytes) / 16;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>(4 * static_cast<size_t>(sms), (units + 511) / 512));
  const double floor_us = GraphMicros(
      [&](int l) {
        RwFloor<<<blocks, 512, 0, stream>>>(static_cast<const uint4*>(in(l)), in_bytes / 16,
                                            reinterpret_cast<uint4*>(b.xq[l]), out_bytes / 16);
        BENCH_CHECK(cudaGetLastError());
      },
      kLayers, 20, stream);
  PrintRow(name + "_read", shape, m, floor_us, static_cast<double>(in_bytes + out_bytes), 0);
}

// One input width's rows: both act_quant variants and act_quant_f32 (in column groups of
// group_cols when not 0), and with `swiglu` the fused SwiGLU.
void QuantShapeRows(const Buffers& b, const char* shape, int64_t k, int64_t m, int64_t group_cols,
                    bool swiglu, int sms, cudaStream_t stream) {
  const ActScaleLayout split = ActScaleLayout::kGemmSplit;
  const size_t out_bytes = static_cast<size_t>(m * k + m * (k / kActQuantBlock) * 4);
  const size_t bf16_bytes = static_cast<size_t>(m * k * 2);
  for (ActQuantVariant v : {ActQuantVariant::kWarpPerBlock, ActQuantVariant::kHalfWarpVectorized}) {
    const std::string name =
        v == ActQuantVariant::kWarpPerBlock ? "act_quant_warp" : "act_quant_vec";
    TimeWithFloor(
        name, shape, m, bf16_bytes, out_bytes, [&](int l) { return b.x[l]; },
        [&](int l) {
          BENCH_CHECK(act_quant(b.x[l], m, k, k, false, b.xq[l], b.xs[l], split, v, stream));
        },
        b, sms, stream);
  }
  TimeWithFloor(
      "act_quant_f32", shape, m, 2 * bf16_bytes, out_bytes, [&](int l) { return b.x32[l]; },
      [&](int l) {
        BENCH_CHECK(act_quant_f32(b.x32[l], m, k, k, false, nullptr, 0, b.xq[l], b.xs[l], split,
                                  stream, group_cols));
      },
      b, sms, stream);
  if (swiglu) {
    TimeWithFloor(
        "swiglu_quant", shape, m, 4 * bf16_bytes, out_bytes, [&](int l) { return b.x32[l]; },
        [&](int l) {
          BENCH_CHECK(clamped_swiglu_act_quant(b.x32[l], b.x32[l] + k, m, k, 2 * k, 7.0f, false,
                                               nullptr, 0, b.xq[l], b.xs[l], split, stream));
        },
        b, sms, stream);
  }
}

// The four GEMM inputs at kTokens, and wo_a's input (the attention output, [m, 64 x 512]; the
// engine quantizes it in o_a's 8 column groups) at the token counts the buffers hold.
void QuantRows(const Buffers& b, int sms, cudaStream_t stream) {
  for (const DenseShape& s : kV4FlashShapes) {
    for (int64_t m : kTokens) {
      // w2: the SwiGLU feeds it ([m, 2k] fp32 in).
      const bool swiglu = s.k == 2048 && 2 * m * s.k <= kMaxTokens * kMaxK;
      QuantShapeRows(b, s.name, s.k, m, 0, swiglu, sms, stream);
    }
  }
  constexpr int64_t kAttnWidth = 64 * 512;
  for (int64_t m : {int64_t{512}, int64_t{2048}}) {
    QuantShapeRows(b, "wo_a", kAttnWidth, m, kAttnWidth / 8, false, sms, stream);
  }
}

void GemmRows(const Buffers& b, cudaStream_t stream) {
  BENCH_CHECK(fp8_gemm_prepare());
  size_t ws_bytes = 0;
  for (const DenseShape& s : kV4FlashShapes) {
    ws_bytes = std::max({ws_bytes, fp8_gemm_workspace_bytes(kMaxTokens, s.n, s.k),
                         fp8_gemm_quantized_workspace_bytes(kMaxTokens, s.n, s.k)});
  }
  void* ws = DeviceAlloc<unsigned char>(ws_bytes);
  auto* out = reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(kMaxTokens * 32768));
  for (const DenseShape& s : kV4FlashShapes) {
    const size_t w_bytes = static_cast<size_t>(s.n * s.k);
    const size_t scales = static_cast<size_t>(((s.n + 127) / 128) * (s.k / 128));
    std::vector<uint8_t*> w(kLayers);
    std::vector<float*> sc(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      w[l] = RandomWeights(w_bytes, 977u * l + 1);
      sc[l] = DeviceAlloc<float>(scales);
      FillScales<<<256, 256>>>(sc[l], nullptr, scales, 31u * l);
      BENCH_CHECK(cudaGetLastError());
    }
    const double bytes = static_cast<double>(w_bytes + 4 * scales);
    for (int64_t m : kTokens) {
      const double flops = 2.0 * m * s.n * s.k;
      const double full = GraphMicros(
          [&](int l) {
            BENCH_CHECK(fp8_gemm(b.x[l], m, s.k, s.k, w[l], sc[l], s.n, false, out, s.n, ws,
                                 ws_bytes, stream));
          },
          kLayers, 20, stream);
      PrintRow("fp8_gemm", s.name, m, full, bytes, flops);
      for (int l = 0; l < kLayers; ++l) {
        BENCH_CHECK(act_quant(b.x[l], m, s.k, s.k, false, b.xq[l], b.xs[l],
                              ActScaleLayout::kGemmSplit, ActQuantVariant::kWarpPerBlock, stream));
      }
      const double quantized = GraphMicros(
          [&](int l) {
            BENCH_CHECK(fp8_gemm_quantized(b.xq[l], b.xs[l], m, s.k, w[l], sc[l], s.n, out, s.n, ws,
                                           ws_bytes, stream));
          },
          kLayers, 20, stream);
      PrintRow("fp8_quantized", s.name, m, quantized, bytes, flops);
    }
    for (int l = 0; l < kLayers; ++l) {
      BENCH_CHECK(cudaFree(w[l]));
      BENCH_CHECK(cudaFree(sc[l]));
    }
  }
  BENCH_CHECK(cudaFree(ws));
  BENCH_CHECK(cudaFree(out));
}

int Run(const std::string& only) {
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Buffers b = Allocate();
  if (only.empty() || only == "quant") QuantRows(b, sms, stream);
  if (only.empty() || only == "gemm") GemmRows(b, stream);
  return 0;
}

}  // namespace
}  // namespace pdserve::kernels::cuda

int main(int argc, char** argv) { return pdserve::kernels::cuda::Run(argc > 1 ? argv[1] : ""); }
