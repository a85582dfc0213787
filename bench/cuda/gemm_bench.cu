// Times the block-scaled FP8 / FP4 GEMMs (kernels/cuda/fp8_gemm.cuh, moe_gemm.cuh) at
// DeepSeek-V4-Flash shapes (engine/config.h: hidden 4096, q_lora 1024, 64 heads x 512, o_groups 8
// x o_lora 1024, 256 routed experts of 2048, top-6), timed inside CUDA graphs. Prints CSV rows:
//   kernel,shape,tokens,median_us,bytes,flops
// kernel: copy (device-to-device, bytes = read + written), read (ReadFloor: bytes read), fp8_wgmma
// (fp8_gemm_wgmma, default config), fp8_mma (fp8_gemm_mma), fp8_cublaslt (fp8_gemm_cublaslt),
// w8a16_wgmma / w8a16_mma (fp8_gemm_w8a16_wgmma, default config / fp8_gemm_w8a16_mma; up to 128
// tokens),
// wgmma_v<warpgroups>.<stages>.<target blocks> (fp8_gemm_wgmma with that config, at kVariantTokens;
// the configs: PDSERVE_FP8_VARIANTS="w,s,t;w,s,t;..." or Variants(); PDSERVE_BENCH_NO_WGMMA set:
// no wgmma rows, and fp8_gemm's default path is left to PDSERVE_FP8_GEMM), moe_fp8 / moe_fp4
// (moe_grouped_gemm over 256 experts, top-6 routing); with the argument "w8a16": fp8_own
// (fp8_gemm) and w8a16 (fp8_gemm_w8a16), moe_fp8
// and moe_w8a16 (ExpertFormat::kFp8W8A16) at decode sizes 1..128 and 4096 tokens only; with
// "moe_prefill": the grouped mma.sync and warpgroup-MMA paths at 512-8192 tokens (MoePrefillRows).
// shape: wq_b [32768, 1024], wo_b [4096, 8192], w13 = experts' gate+up [4096, 4096] and w2 = down
// [4096, 2048] (dense rows: one expert's matrix as a plain GEMM). bytes: the weight and scale bytes
// the call must read (grouped: of the experts the routing touched, averaged over the layers),
// flops: 2 x tokens (x top-6) x n x k. Every time includes the activation quantization kernel (and
// the split-k reduction or grouping kernel where they run).
//
// Graph timing: one launch per layer of kLayers layers captured in one CUDA graph, median over
// 20 replays of (replay time / kLayers). Dense layers each have their own weights (16 x the
// matrix: 128-512 MB, beyond L2); grouped layers share one expert tensor (4.3 GB gate+up FP8)
// with their own random routing, so a decode batch's experts come from HBM.
// bench/cuda/compare.py --gemm-bench runs this and PyTorch's counterparts in one run.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/cuda/bench_util.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/moe_gemm.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kLayers = 16;
constexpr int kMoeLayers = 8;
constexpr int64_t kExperts = 256;
constexpr int64_t kTopK = 6;
const std::vector<int64_t> kTokens = {1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 4096, 8192};
const std::vector<int64_t> kW8a16Tokens = {1, 4, 16, 32, 64, 128, 4096};
const std::vector<int64_t> kVariantTokens = {1, 8, 16, 32, 64, 128};

// The fp8_gemm_wgmma configs the sweep times (warpgroups, stages, target blocks).
std::vector<Fp8WgmmaConfig> Variants() {
  if (const char* env = std::getenv("PDSERVE_FP8_VARIANTS")) {
    std::vector<Fp8WgmmaConfig> v = ParseWgmmaConfigs(env);
    if (!v.empty()) return v;
  }
  std::vector<Fp8WgmmaConfig> v;
  for (int wgs : {1, 2}) {
    for (int stages : {4, 6, 8}) {
      for (int target : {132, 264, 528}) v.push_back(Fp8WgmmaConfig{wgs, stages, target});
    }
  }
  return v;
}

std::string VariantName(const Fp8WgmmaConfig& c) {
  return "wgmma_v" + std::to_string(c.warpgroups) + "." + std::to_string(c.stages) + "." +
         std::to_string(c.target_blocks) + (c.cluster_reduce ? ".c" : "") +
         (c.a16_cluster_reduce_tokens != 0 ? ".A" + std::to_string(c.a16_cluster_reduce_tokens)
                                           : "");
}

using Shape = DenseShape;
const std::vector<Shape>& kShapes = kV4FlashShapes;

void PrintRow(const char* kernel, const char* shape, int64_t tokens, double us, double bytes,
              double flops) {
  std::printf("%s,%s,%lld,%.3f,%.0f,%.0f\n", kernel, shape, static_cast<long long>(tokens), us,
              bytes, flops);
  std::fflush(stdout);
}

// w8a16: fp8_own and w8a16 rows at kW8a16Tokens (no cuBLASLt).
void DenseRows(cudaStream_t stream, cublasLtHandle_t lt, const __nv_bfloat16* x, __nv_bfloat16* out,
               void* ws, size_t ws_bytes, bool w8a16) {
  for (const Shape& s : kShapes) {
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
    for (int64_t m : w8a16 ? kW8a16Tokens : kTokens) {
      const double flops = 2.0 * m * s.n * s.k;
      if (w8a16) {
        const double own = GraphMicros(
            [&](int l) {
              BENCH_CHECK(
                  fp8_gemm(x, m, s.k, s.k, w[l], sc[l], s.n, true, out, s.n, ws, ws_bytes, stream));
            },
            kLayers, 20, stream);
        PrintRow("fp8_own", s.name, m, own, bytes, flops);
        const double a16 = GraphMicros(
            [&](int l) {
              BENCH_CHECK(
                  fp8_gemm_w8a16(x, m, s.k, s.k, w[l], sc[l], s.n, out, s.n, ws, ws_bytes, stream));
            },
            kLayers, 20, stream);
        PrintRow("w8a16", s.name, m, a16, bytes, flops);
        continue;
      }
      const bool wgmma = std::getenv("PDSERVE_BENCH_NO_WGMMA") == nullptr;
      const Fp8WgmmaConfig config = fp8_gemm_wgmma_default_config();
      if (wgmma) {
        const double wgmma_us = GraphMicros(
            [&](int l) {
              BENCH_CHECK(fp8_gemm_wgmma(x, m, s.k, s.k, w[l], sc[l], s.n, true, out, s.n, ws,
                                         ws_bytes, stream, config));
            },
            kLayers, 20, stream);
        PrintRow("fp8_wgmma", s.name, m, wgmma_us, bytes, flops);
      }
      if (wgmma && m <= 128) {  // W8A16 rows: decode sizes only
        const double a16_us = GraphMicros(
            [&](int l) {
              BENCH_CHECK(fp8_gemm_w8a16_wgmma(x, m, s.k, s.k, w[l], sc[l], s.n, out, s.n, ws,
                                               ws_bytes, stream, config));
            },
            kLayers, 20, stream);
        PrintRow("w8a16_wgmma", s.name, m, a16_us, bytes, flops);
        const double a16_mma_us = GraphMicros(
            [&](int l) {
              BENCH_CHECK(fp8_gemm_w8a16_mma(x, m, s.k, s.k, w[l], sc[l], s.n, out, s.n, ws,
                                             ws_bytes, stream));
            },
            kLayers, 20, stream);
        PrintRow("w8a16_mma", s.name, m, a16_mma_us, bytes, flops);
      }
      const double mma_us = GraphMicros(
          [&](int l) {
            BENCH_CHECK(fp8_gemm_mma(x, m, s.k, s.k, w[l], sc[l], s.n, true, out, s.n, ws, ws_bytes,
                                     stream));
          },
          kLayers, 20, stream);
      PrintRow("fp8_mma", s.name, m, mma_us, bytes, flops);
      if (wgmma &&
          std::find(kVariantTokens.begin(), kVariantTokens.end(), m) != kVariantTokens.end()) {
        for (const Fp8WgmmaConfig& v : Variants()) {
          const double us = GraphMicros(
              [&](int l) {
                BENCH_CHECK(fp8_gemm_wgmma(x, m, s.k, s.k, w[l], sc[l], s.n, true, out, s.n, ws,
                                           ws_bytes, stream, v));
              },
              kLayers, 20, stream);
          PrintRow(VariantName(v).c_str(), s.name, m, us, bytes, flops);
        }
      }
      std::string refusal;
      const cudaError_t probe = fp8_gemm_cublaslt(lt, x, m, s.k, s.k, w[0], sc[0], s.n, true, out,
                                                  s.n, ws, ws_bytes, stream, &refusal);
      if (probe != cudaSuccess) {
        std::fprintf(stderr, "cublaslt %s m=%lld: %s\n", s.name, static_cast<long long>(m),
                     refusal.c_str());
        continue;
      }
      const double lt_us = GraphMicros(
          [&](int l) {
            BENCH_CHECK(fp8_gemm_cublaslt(lt, x, m, s.k, s.k, w[l], sc[l], s.n, true, out, s.n, ws,
                                          ws_bytes, stream));
          },
          kLayers, 20, stream);
      PrintRow("fp8_cublaslt", s.name, m, lt_us, bytes, flops);
    }
    for (int l = 0; l < kLayers; ++l) {
      BENCH_CHECK(cudaFree(w[l]));
      BENCH_CHECK(cudaFree(sc[l]));
    }
  }
}

// w8a16: FP8 and W8A16 experts at kW8a16Tokens.
void MoeRows(cudaStream_t stream, const __nv_bfloat16* x, __nv_bfloat16* out, float* pick_w,
             void* ws, size_t ws_bytes, bool w8a16) {
  std::mt19937_64 rng(12345);
  std::vector<int32_t*> experts(kMoeLayers);
  for (int32_t*& e : experts) e = DeviceAlloc<int32_t>(kTokens.back() * kTopK);
  for (const Shape& s : {kShapes[2], kShapes[3]}) {
    const std::vector<ExpertFormat> formats =
        w8a16 ? std::vector<ExpertFormat>{ExpertFormat::kFp8, ExpertFormat::kFp8W8A16}
              : std::vector<ExpertFormat>{ExpertFormat::kFp8, ExpertFormat::kFp4};
    for (ExpertFormat format : formats) {
      const bool fp4 = format == ExpertFormat::kFp4;
      ExpertWeights ew;
      ew.format = format;
      ew.n_experts = kExperts;
      ew.n = s.n;
      ew.k = s.k;
      const size_t w_bytes = static_cast<size_t>(kExperts * s.n * s.k / (fp4 ? 2 : 1));
      const size_t scales = fp4 ? static_cast<size_t>(kExperts * s.n * s.k / 32)
                                : static_cast<size_t>(kExperts * (s.n / 128) * (s.k / 128));
      uint8_t* w = RandomWeights(w_bytes, fp4 ? 7u : 5u);
      float* sc = fp4 ? nullptr : DeviceAlloc<float>(scales);
      uint8_t* sc8 = fp4 ? DeviceAlloc<uint8_t>(scales) : nullptr;
      FillScales<<<1024, 256>>>(sc, sc8, scales, 3u);
      BENCH_CHECK(cudaGetLastError());
      ew.w = w;
      ew.scale = sc;
      ew.scale_e8m0 = sc8;
      const double expert_bytes = static_cast<double>(w_bytes) / kExperts +
                                  static_cast<double>(scales) / kExperts * (fp4 ? 1 : 4);
      const bool down = s.k == 2048;  // w2 takes one row per pick
      for (int64_t m : w8a16 ? kW8a16Tokens : kTokens) {
        const double distinct = RandomRoutings(m, kExperts, kTopK, experts, rng);
        const double us = GraphMicros(
            [&](int l) {
              BENCH_CHECK(moe_grouped_gemm(x, s.k, down, experts[l], down ? pick_w : nullptr, m,
                                           kTopK, ew, true, out, s.n, ws, ws_bytes, stream));
            },
            kMoeLayers, 20, stream);
        const char* name = fp4                                 ? "moe_fp4"
                           : format == ExpertFormat::kFp8W8A16 ? "moe_w8a16"
                                                               : "moe_fp8";
        PrintRow(name, s.name, m, us, distinct * expert_bytes, 2.0 * m * kTopK * s.n * s.k);
      }
      BENCH_CHECK(cudaFree(w));
      if (sc != nullptr) BENCH_CHECK(cudaFree(sc));
      if (sc8 != nullptr) BENCH_CHECK(cudaFree(sc8));
    }
  }
  for (int32_t* e : experts) BENCH_CHECK(cudaFree(e));
}

// "moe_prefill": FP8 and W8A16 experts at kPrefillTokens through both grouped paths on the same
// routings: moe_fp8 / moe_w8a16 (moe_grouped_gemm_mma), moe_fp8_wgmma / moe_w8a16_wgmma
// (moe_grouped_gemm_wgmma, default config) and, per PDSERVE_MOE_WGMMA_VARIANTS=
// "tile,stages[,multicast];..." (default "64,0;128,0;0,0,1": the tile the default does not take,
// and multicast_activations), moe_fp8_wg<tile>.<stages>[.m] / moe_w8a16_wg<tile>.<stages>[.m].
// At the first size, stderr gets "check" lines: the wgmma output of each tile (and multicast when
// a variant has it) against the mma one over every pick row (max |difference| / max |mma|, NaNs).
// PDSERVE_MOE_PREFILL_MMA_ONLY set: the mma rows only.
const std::vector<int64_t> kPrefillTokens = {512, 2048, 4096, 8192};
constexpr int kPrefillReps = 7;  // graph replays (each milliseconds long at these sizes)

std::vector<MoeWgmmaConfig> MoeVariants() {
  const char* env = std::getenv("PDSERVE_MOE_WGMMA_VARIANTS");
  const std::string text = env != nullptr ? env : "64,0;128,0;0,0,1";
  std::vector<MoeWgmmaConfig> v;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find(';', at), text.size());
    MoeWgmmaConfig c;
    int multicast = 0;
    if (std::sscanf(text.substr(at, end - at).c_str(), "%d,%d,%d", &c.token_tile, &c.stages,
                    &multicast) >= 2) {
      c.multicast_activations = multicast == 1;
      v.push_back(c);
    }
    at = end + 1;
  }
  return v;
}

void CheckPaths(const char* what, const char* shape, const __nv_bfloat16* a, const __nv_bfloat16* b,
                int64_t rows, int64_t n) {
  std::vector<uint16_t> ha(static_cast<size_t>(rows * n));
  std::vector<uint16_t> hb(ha.size());
  BENCH_CHECK(cudaMemcpy(ha.data(), a, ha.size() * 2, cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(hb.data(), b, hb.size() * 2, cudaMemcpyDeviceToHost));
  const auto value = [](uint16_t bits) {
    const uint32_t u = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  double max_ref = 0.0;
  double max_diff = 0.0;
  int64_t nan_a = 0;
  int64_t nan_b = 0;
  for (size_t i = 0; i < ha.size(); ++i) {
    const float va = value(ha[i]);
    const float vb = value(hb[i]);
    nan_a += std::isnan(va) ? 1 : 0;
    nan_b += std::isnan(vb) ? 1 : 0;
    if (!std::isfinite(va) || !std::isfinite(vb)) continue;
    max_ref = std::max(max_ref, std::fabs(double{va}));
    max_diff = std::max(max_diff, std::fabs(double{va} - vb));
  }
  std::fprintf(stderr,
               "check %s %s rows %lld: max |wgmma - mma| / max |mma| = %.3g, NaN %lld / %lld\n",
               what, shape, static_cast<long long>(rows), max_diff / std::max(max_ref, 1e-30),
               static_cast<long long>(nan_b), static_cast<long long>(nan_a));
}

void MoePrefillRows(cudaStream_t stream, const __nv_bfloat16* x, __nv_bfloat16* out,
                    __nv_bfloat16* out2, float* pick_w, void* ws, size_t ws_bytes) {
  std::mt19937_64 rng(12345);
  std::vector<int32_t*> experts(kMoeLayers);
  for (int32_t*& e : experts) e = DeviceAlloc<int32_t>(kPrefillTokens.back() * kTopK);
  for (const Shape& s : {kShapes[2], kShapes[3]}) {
    const size_t w_bytes = static_cast<size_t>(kExperts * s.n * s.k);
    const size_t scales = static_cast<size_t>(kExperts * (s.n / 128) * (s.k / 128));
    uint8_t* w = RandomWeights(w_bytes, 5u);
    float* sc = DeviceAlloc<float>(scales);
    FillScales<<<1024, 256>>>(sc, nullptr, scales, 3u);
    BENCH_CHECK(cudaGetLastError());
    const double expert_bytes = static_cast<double>(w_bytes + 4 * scales) / kExperts;
    const bool down = s.k == 2048;  // w2 takes one row per pick
    for (int64_t m : kPrefillTokens) {
      const double distinct = RandomRoutings(m, kExperts, kTopK, experts, rng);
      const double bytes = distinct * expert_bytes;
      const double flops = 2.0 * m * kTopK * s.n * s.k;
      for (ExpertFormat format : {ExpertFormat::kFp8, ExpertFormat::kFp8W8A16}) {
        const bool a16 = format == ExpertFormat::kFp8W8A16;
        const std::string prefix = a16 ? "moe_w8a16" : "moe_fp8";
        ExpertWeights ew;
        ew.format = format;
        ew.w = w;
        ew.scale = sc;
        ew.n_experts = kExperts;
        ew.n = s.n;
        ew.k = s.k;
        const float* weights = down ? pick_w : nullptr;
        const auto mma = [&](int l, __nv_bfloat16* o) {
          BENCH_CHECK(moe_grouped_gemm_mma(x, s.k, down, experts[l], weights, m, kTopK, ew, true, o,
                                           s.n, ws, ws_bytes, stream));
        };
        const auto wgmma = [&](int l, __nv_bfloat16* o, const MoeWgmmaConfig& c) {
          BENCH_CHECK(moe_grouped_gemm_wgmma(x, s.k, down, experts[l], weights, m, kTopK, ew, true,
                                             o, s.n, ws, ws_bytes, stream, c));
        };
        const MoeWgmmaConfig config = moe_grouped_gemm_wgmma_default_config();
        const bool wgmma_rows = std::getenv("PDSERVE_MOE_PREFILL_MMA_ONLY") == nullptr;
        if (wgmma_rows && m == kPrefillTokens.front()) {
          mma(0, out);
          const std::vector<MoeWgmmaConfig> variants = MoeVariants();
          const bool multicast = std::any_of(variants.begin(), variants.end(),
                                             [](const auto& v) { return v.multicast_activations; });
          for (const MoeWgmmaConfig c :
               {MoeWgmmaConfig{64, 0, false}, MoeWgmmaConfig{128, 0, false},
                MoeWgmmaConfig{0, 0, true}}) {
            if (c.multicast_activations && !multicast) continue;  // (its tests failed)
            wgmma(0, out2, c);
            BENCH_CHECK(cudaStreamSynchronize(stream));
            CheckPaths((prefix + " tile " + std::to_string(c.token_tile) +
                        (c.multicast_activations ? " multicast" : ""))
                           .c_str(),
                       s.name, out, out2, m * kTopK, s.n);
          }
        }
        PrintRow(prefix.c_str(), s.name, m,
                 GraphMicros([&](int l) { mma(l, out); }, kMoeLayers, kPrefillReps, stream), bytes,
                 flops);
        if (!wgmma_rows) continue;
        PrintRow(
            (prefix + "_wgmma").c_str(), s.name, m,
            GraphMicros([&](int l) { wgmma(l, out, config); }, kMoeLayers, kPrefillReps, stream),
            bytes, flops);
        // (The default config's tile by moe_grouped_gemm_wgmma's rule: a variant equal to it
        // is not timed twice.)
        const int default_tile = m * kTopK > 64 * std::min<int64_t>(kExperts, m * kTopK) ? 128 : 64;
        for (const MoeWgmmaConfig& v : MoeVariants()) {
          if (config.token_tile == 0 && config.stages == 0 && !config.multicast_activations &&
              v.token_tile == default_tile && v.stages == 0 && !v.multicast_activations) {
            continue;
          }
          const std::string name = prefix + "_wg" + std::to_string(v.token_tile) + "." +
                                   std::to_string(v.stages) + (v.multicast_activations ? ".m" : "");
          PrintRow(name.c_str(), s.name, m,
                   GraphMicros([&](int l) { wgmma(l, out, v); }, kMoeLayers, kPrefillReps, stream),
                   bytes, flops);
        }
      }
    }
    BENCH_CHECK(cudaFree(w));
    BENCH_CHECK(cudaFree(sc));
  }
  for (int32_t* e : experts) BENCH_CHECK(cudaFree(e));
}

int Run(const std::string& only) {
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Ceilings, timed by events outside graphs (a graph's memcpy node ran at 2.8 TB/s, the
  // runtime's own copy kernel at ~4.3): a 2 GiB device-to-device copy (bytes read + written) and
  // ReadFloor over 2 GiB (bytes read), the floor of a kernel that only reads its weights.
  const size_t copy_bytes = size_t{2} << 30;
  void* src = DeviceAlloc<unsigned char>(copy_bytes);
  void* dst = DeviceAlloc<unsigned char>(copy_bytes);
  BENCH_CHECK(cudaMemset(src, 1, copy_bytes));
  const auto events_us = [&](const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    return EventMedianMicros([](int) {}, fn, 10, stream);
  };
  const double copy_us = events_us([&] {
    BENCH_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
  });
  PrintRow("copy", "-", 0, copy_us, 2.0 * copy_bytes, 0);
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint4* sink = DeviceAlloc<uint4>(1);
  const double read_us = events_us([&] {
    ReadFloor<<<4 * sms, 512, 0, stream>>>(static_cast<const uint4*>(src), copy_bytes / 16, sink);
    BENCH_CHECK(cudaGetLastError());
  });
  PrintRow("read", "-", 0, read_us, static_cast<double>(copy_bytes), 0);
  BENCH_CHECK(cudaFree(src));
  BENCH_CHECK(cudaFree(dst));

  const int64_t max_rows = kTokens.back() * kTopK;
  const int64_t max_k = 8192;
  const int64_t max_n = 32768;
  auto* x = reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(max_rows * max_k));
  FillBf16(reinterpret_cast<uint16_t*>(x), max_rows * max_k, 99);
  auto* out = reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(max_rows * max_n));
  float* pick_w = DeviceAlloc<float>(max_rows);
  FillScales<<<64, 256>>>(pick_w, nullptr, max_rows, 17);
  size_t ws_bytes = fp8_gemm_cublaslt_workspace_bytes(kTokens.back(), max_n, max_k);
  for (const Shape& s : kShapes) {
    for (int64_t m : kTokens) {
      ws_bytes = std::max(ws_bytes, fp8_gemm_workspace_bytes(m, s.n, s.k));
      ws_bytes = std::max(
          ws_bytes, fp8_gemm_wgmma_workspace_bytes(m, s.n, s.k, fp8_gemm_wgmma_default_config()));
      for (const Fp8WgmmaConfig& v : Variants()) {
        ws_bytes = std::max(ws_bytes, fp8_gemm_wgmma_workspace_bytes(m, s.n, s.k, v));
      }
    }
    for (ExpertFormat f : {ExpertFormat::kFp8, ExpertFormat::kFp4}) {
      ExpertWeights ew;
      ew.format = f;
      ew.n_experts = kExperts;
      ew.n = s.n;
      ew.k = s.k;
      for (int64_t m : kTokens) {
        ws_bytes = std::max(ws_bytes, moe_grouped_gemm_workspace_bytes(m, kTopK, m * kTopK, ew));
      }
    }
  }
  const bool prefill = only == "moe_prefill";
  for (const Shape& s : {kShapes[2], kShapes[3]}) {
    for (ExpertFormat f : {ExpertFormat::kFp8, ExpertFormat::kFp8W8A16}) {
      ExpertWeights ew;
      ew.format = f;
      ew.n_experts = kExperts;
      ew.n = s.n;
      ew.k = s.k;
      for (int64_t m : prefill ? kPrefillTokens : std::vector<int64_t>{}) {
        ws_bytes =
            std::max(ws_bytes, moe_grouped_gemm_mma_workspace_bytes(m, kTopK, m * kTopK, ew));
        for (MoeWgmmaConfig c : MoeVariants()) {
          ws_bytes = std::max(ws_bytes,
                              moe_grouped_gemm_wgmma_workspace_bytes(m, kTopK, m * kTopK, ew, c));
        }
        ws_bytes = std::max(ws_bytes,
                            moe_grouped_gemm_wgmma_workspace_bytes(
                                m, kTopK, m * kTopK, ew, moe_grouped_gemm_wgmma_default_config()));
      }
    }
  }
  void* ws = DeviceAlloc<unsigned char>(ws_bytes);
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return 1;
  BENCH_CHECK(cudaDeviceSynchronize());
  const bool w8a16 = only == "w8a16";
  if (only.empty() || only == "dense" || w8a16) DenseRows(stream, lt, x, out, ws, ws_bytes, w8a16);
  if (only.empty() || only == "moe" || w8a16) MoeRows(stream, x, out, pick_w, ws, ws_bytes, w8a16);
  if (prefill) {
    auto* out2 = reinterpret_cast<__nv_bfloat16*>(
        DeviceAlloc<uint16_t>(kPrefillTokens.front() * kTopK * 4096));
    MoePrefillRows(stream, x, out, out2, pick_w, ws, ws_bytes);
    BENCH_CHECK(cudaFree(out2));
  }
  cublasLtDestroy(lt);
  return 0;
}

}  // namespace
}  // namespace pdserve::kernels::cuda

// Optional argument: "dense" or "moe" runs only those rows, "w8a16" the W8A16 comparison,
// "moe_prefill" the grouped paths at prefill sizes (MoePrefillRows).
int main(int argc, char** argv) { return pdserve::kernels::cuda::Run(argc > 1 ? argv[1] : ""); }
