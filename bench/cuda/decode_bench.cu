// Decode-size bandwidth of the block-scaled FP8 GEMMs (kernels/cuda/fp8_gemm.cuh, moe_gemm.cuh)
// against the read floor of the same bytes (issue 25's decode goal: >= 80% of it at batch
// 1..128). Prints CSV rows:
//   kernel,shape,tokens,median_us,bytes
// Mode "gemm" (default): V4-Flash's dense shapes (gemm_bench.cu's: wq_b [32768, 1024], wo_b
// [4096, 8192], w13 [4096, 4096], w2 [4096, 2048]) at 1, 8, 16, 32, 64, 128 tokens. kernel:
//   read (ReadFloor over each layer's weight bytes: the floor a kernel that only reads them
//   reaches, timed the same way), empty (an empty kernel per layer: the launch floor of a graph),
//   fp8 / w8a16 (fp8_gemm / fp8_gemm_w8a16: the engine's calls, with their dispatch),
//   fp8_before / w8a16_before (the dispatch thresholds and wgmma config main had before this
//   bench: mma.sync up to 8 / 32 tokens, else wgmma 1,4,264 without the flags; the kernels are
//   today's, so the mma.sync rows reduce their k splits in the kernel),
//   stream_<stages>.<target> (TmaStreamKernel: fp8_gemm_wgmma's weight stream without its math;
//   1 token only), streamx_<stages>.<target> (the same with each stage's activation box of the
//   token tile, at every token count), fp8_mma / w8a16_mma, fp8_wgmma / w8a16_wgmma (the default
//   config without cluster_reduce), fp8_wgmma_c / w8a16_wgmma_c (the default config with it),
//   fp8_v<w>.<s>.<t>[.c][.s][.r][.a][.i][.t][.k][.m] / w8a16_v<...> (fp8_gemm_wgmma /
//   fp8_gemm_w8a16_wgmma with that config: warpgroups, stages, target blocks, cluster_reduce,
//   smem_scales, a16_register_weights, alternate_turns, two_in_flight, split_tokens, stagger_k,
//   multicast_activations, .x<R>: max_registers R;
//   PDSERVE_FP8_VARIANTS="w,s,t,c,x,r,a,i,p,k,m,R;..." or kVariants; PDSERVE_DECODE_NO_CLUSTER set:
//   none with cluster_reduce).
// Mode "layer": the GEMMs of one V4-Flash compressed-sparse-attention layer's decode step as
// engine/gpu/gpu_model.cc calls them (q_a, q_b, kv, the compressor's kv / gate, the indexer
// compressor's kv / gate, indexer q_b and weights, o_a as 8 group GEMMs, o_b; the shared expert's
// gate, up, down; the routed experts' gate+up and down through moe_grouped_gemm with a random
// top-6 routing of 256 experts), every weight FP8 e4m3 with 128 x 128 scales, at the same batch
// sizes. kernel: layer_w8a16 (fp8_gemm_w8a16 + kFp8W8A16 experts: the engine's default),
// layer_fp8 (fp8_gemm + kFp8 experts), layer_read (ReadFloor over one buffer of the same bytes
// per layer); each also as _dense (the dense GEMMs alone), _moe (the routed experts alone) and
// _dense_fused (the dense GEMMs with the nine projections of the layer input as one GEMM and
// o_a's groups as one, see MakeLayerGemms), _dense_fused_q (_dense_fused with q_b_proj and the
// indexer's q_b_proj, which read the same normalized q_a output, as one GEMM too). bytes: the dense
// weights + scales and the experts the routing touched. The elementwise kernels between the GEMMs
// (norms, rope, SwiGLU, combine) and the fp32 router GEMM are not in it. The down call reuses the
// gate+up call's grouping of the picks (MoeMmaGrouping::kReuse) as the engine's does
// (PDSERVE_DECODE_MOE_REUSE=0: it groups them again). fp8_gemm's path and config
// come from PDSERVE_FP8_GEMM / PDSERVE_FP8_WGMMA.
//
// PDSERVE_BLOCK_TRACE=<file>: each gemm-mode row's block timelines (the wgmma GEMM kernel and
// TmaStreamKernel are instrumented; bench_util.cuh's GraphTrace) appended to <file>.
//
// Timing as gemm_bench.cu: one launch (or layer step) per layer, kLayers layers in one CUDA
// graph, each layer its own dense weights (beyond L2), median of 20 replays / kLayers.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda/bench_util.cuh"
#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/moe_gemm.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kLayers = 16;
constexpr int kStepLayers = 4;
constexpr int kReps = 20;
constexpr int64_t kExperts = 256;
constexpr int64_t kTopK = 6;
const std::vector<int64_t> kTokens = {1, 8, 16, 32, 64, 128};
const char* const kVariants =
    "0,0,264,1,1,1;0,2,264,0,1,1;0,4,264,0,1,1;0,6,264,0,1,1;0,8,264,0,1,1;0,0,528,0,1,1;"
    "0,0,132,0,1,1;2,0,264,0,1,1;0,0,264,0,0,1;0,0,264,0,1,0";

__global__ void EmptyKernel() {}

// The weight stream of fp8_gemm_wgmma without its math: a producer thread copies [64 x 128-byte]
// boxes of rows 64 blockIdx.x.. and k split blockIdx.y by TMA through a ring of `stages` stages
// of shared memory, one consumer warpgroup waits for each and releases it. With x_bytes > 0 each
// stage also takes the activation box of the same 128 k ([x_bytes / 128 tokens x 128 bytes] of
// x_map, as the W8A8 GEMM loads it). Its time against "read" says what the access pattern and the
// ring cost; against the GEMM, what its math costs.
constexpr int kStreamMaxStages = 8;
__global__ void __launch_bounds__(160, 1)
    TmaStreamKernel(const __grid_constant__ CUtensorMap w_map,
                    const __grid_constant__ CUtensorMap x_map, int64_t kblocks, int splits,
                    int stages, uint32_t x_bytes, BlockTrace trace_to) {
  namespace h = hopper;
  extern __shared__ uint8_t smem_raw[];
  const trace::BlockTraceScope traced(trace_to);
  const uint32_t base = (h::SharedAddress(smem_raw) + 1023u) & ~1023u;
  const uint32_t stage_bytes = 8192u + x_bytes;
  const uint32_t full = base + stages * stage_bytes;
  const uint32_t empty = full + 8u * kStreamMaxStages;
  const int kb_begin = static_cast<int>(kblocks * blockIdx.y / splits);
  const int n_kb = static_cast<int>(kblocks * (blockIdx.y + 1) / splits) - kb_begin;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      h::MbarrierInit(full + 8u * s, 1);
      h::MbarrierInit(empty + 8u * s, 4);
    }
    h::FenceBarrierInit();
  }
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (warp == 4) {
    if (threadIdx.x % 32 == 0) {
      h::PrefetchTensorMap(&w_map);
      if (x_bytes > 0) h::PrefetchTensorMap(&x_map);
      for (int it = 0; it < n_kb; ++it) {
        const int s = it % stages;
        if (it >= stages)
          h::MbarrierWait(empty + 8u * s, static_cast<uint32_t>((it / stages - 1) & 1));
        h::MbarrierArriveExpectTx(full + 8u * s, stage_bytes);
        h::TmaLoad2d(base + s * stage_bytes, &w_map, (kb_begin + it) * 128,
                     static_cast<int32_t>(blockIdx.x * 64), full + 8u * s);
        if (x_bytes > 0) {
          h::TmaLoad2d(base + s * stage_bytes + 8192u, &x_map, (kb_begin + it) * 128, 0,
                       full + 8u * s);
        }
      }
    }
    return;
  }
  for (int it = 0; it < n_kb; ++it) {
    const int s = it % stages;
    h::MbarrierWait(full + 8u * s, static_cast<uint32_t>((it / stages) & 1));
    if (threadIdx.x == 0) {
      if (it == 0) traced.Mark(kTraceFirstData);
      if (it == n_kb - 1) traced.Mark(kTraceLastData);
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) h::MbarrierArrive(empty + 8u * s);
  }
}

// cuTensorMapEncodeTiled of the driver through the runtime (as fp8_gemm_wgmma.cu does).
// box_rows: rows per box (64 for weights; the token tile for activations).
bool EncodeWeights(CUtensorMap* map, const uint8_t* w, int64_t n, int64_t k,
                   uint32_t box_rows = 64) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult result{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                       &result) != cudaSuccess ||
      result != cudaDriverEntryPointSuccess) {
    return false;
  }
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(n)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
  const cuuint32_t box[2] = {128, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(w), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

using Shape = DenseShape;
const std::vector<Shape>& kShapes = kV4FlashShapes;

void PrintRow(const std::string& kernel, const char* shape, int64_t tokens, double us,
              double bytes) {
  std::printf("%s,%s,%lld,%.3f,%.0f\n", kernel.c_str(), shape, static_cast<long long>(tokens), us,
              bytes);
  std::fflush(stdout);
}

std::vector<Fp8WgmmaConfig> Variants() {
  const char* env = std::getenv("PDSERVE_FP8_VARIANTS");
  return ParseWgmmaConfigs(env != nullptr ? env : kVariants);
}

std::string ConfigName(const Fp8WgmmaConfig& c) {
  return std::to_string(c.warpgroups) + "." + std::to_string(c.stages) + "." +
         std::to_string(c.target_blocks) + (c.cluster_reduce ? ".c" : "") +
         (c.smem_scales ? ".s" : "") + (c.a16_register_weights ? ".r" : "") +
         (c.alternate_turns ? ".a" : "") + (c.two_in_flight ? ".i" : "") +
         (c.split_tokens ? ".t" : "") + (c.stagger_k ? ".k" : "") +
         (c.multicast_activations ? ".m" : "") +
         (c.max_registers != 0 ? ".x" + std::to_string(c.max_registers) : "") +
         (c.a16_cluster_reduce_tokens != 0 ? ".A" + std::to_string(c.a16_cluster_reduce_tokens)
                                           : "");
}

// One FP8 weight matrix [n, k] with its 128 x 128 scales.
struct Matrix {
  uint8_t* w = nullptr;
  float* scale = nullptr;
  int64_t n = 0;
  int64_t k = 0;
  size_t Bytes() const { return static_cast<size_t>(n * k + 4 * ((n + 127) / 128) * (k / 128)); }
};

Matrix MakeMatrix(int64_t n, int64_t k, uint32_t seed) {
  Matrix m;
  m.n = n;
  m.k = k;
  m.w = RandomWeights(static_cast<size_t>(n * k), seed);
  const size_t scales = static_cast<size_t>(((n + 127) / 128) * (k / 128));
  m.scale = DeviceAlloc<float>(scales);
  FillScales<<<64, 256>>>(m.scale, nullptr, scales, seed * 7u);
  BENCH_CHECK(cudaGetLastError());
  return m;
}

void FreeMatrix(const Matrix& m) {
  BENCH_CHECK(cudaFree(m.w));
  BENCH_CHECK(cudaFree(m.scale));
}

// ReadFloor over `bytes` at `p` on `stream` (the grid of the 2 GiB floor, fewer blocks for small
// buffers: at least one round of four 16-byte loads per thread).
void LaunchRead(const void* p, size_t bytes, uint4* sink, int sms, cudaStream_t stream) {
  const size_t units = bytes / 16;
  const size_t blocks = std::clamp<size_t>(units / (512 * 4), 1, static_cast<size_t>(4 * sms));
  ReadFloor<<<static_cast<unsigned>(blocks), 512, 0, stream>>>(static_cast<const uint4*>(p), units,
                                                               sink);
  BENCH_CHECK(cudaGetLastError());
}

struct Buffers {
  __nv_bfloat16* x = nullptr;  // [128 * 6, 32768]
  __nv_bfloat16* out = nullptr;
  __nv_bfloat16* out2 = nullptr;
  float* pick_w = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  uint4* sink = nullptr;
  int sms = 0;
};

double Graph(const std::function<void(int)>& launch, int layers, cudaStream_t stream) {
  return GraphMicros(launch, layers, kReps, stream);
}

// PDSERVE_DECODE_SHAPES / _TOKENS / _ROWS: comma lists that limit gemm mode to those shapes
// (wq_b, ...), token counts (layer mode too) and row kernels ("fp8_wgmma", "stream*": a trailing *
// matches a prefix); unset or empty: all. (For Nsight Compute runs of one kernel.)
std::vector<std::string> EnvList(const char* name) {
  std::vector<std::string> items;
  const char* env = std::getenv(name);
  std::string item;
  for (const char* c = env != nullptr ? env : "";; ++c) {
    if (*c == ',' || *c == '\0') {
      if (!item.empty()) items.push_back(item);
      item.clear();
      if (*c == '\0') break;
    } else {
      item += *c;
    }
  }
  return items;
}

bool Wanted(const std::vector<std::string>& list, const std::string& name) {
  if (list.empty()) return true;
  for (const std::string& item : list) {
    if (item == name) return true;
    if (!item.empty() && item.back() == '*' && name.rfind(item.substr(0, item.size() - 1), 0) == 0)
      return true;
  }
  return false;
}

// "stream_<stages>.<target>" rows (1 token): TmaStreamKernel over each layer's weights, k split
// as fp8_gemm_wgmma splits it for one token tile (target blocks / row tiles, at most 8 splits).
// "streamx_<stages>.<target>" rows (m tokens): the same with each stage's activation box of
// round_up(m, 8) tokens (e4m3, one buffer for every layer, as the GEMM's quantized activations).
void StreamRows(const Shape& s, const std::vector<Matrix>& w, int64_t m,
                const std::vector<std::string>& rows, cudaStream_t stream) {
  std::vector<CUtensorMap> maps(w.size());
  for (size_t l = 0; l < w.size(); ++l) {
    if (!EncodeWeights(&maps[l], w[l].w, s.n, s.k)) return;
  }
  static uint8_t* xq = RandomWeights(size_t{128} * 32768, 4242u);
  const uint32_t x_tokens = static_cast<uint32_t>(std::min<int64_t>(128, (m + 7) / 8 * 8));
  CUtensorMap x_map{};
  if (!EncodeWeights(&x_map, xq, x_tokens, s.k, x_tokens)) return;
  const int64_t row_tiles = (s.n + 63) / 64;
  for (const bool with_x : {false, true}) {
    if (!with_x && m != 1) continue;
    for (const std::pair<int, int>& config :
         std::vector<std::pair<int, int>>{{4, 264}, {8, 264}, {4, 528}}) {
      const int stages = config.first;
      const int target = config.second;
      const std::string name = std::string(with_x ? "streamx_" : "stream_") +
                               std::to_string(stages) + "." + std::to_string(target);
      if (!Wanted(rows, name)) continue;
      const uint32_t x_bytes = with_x ? x_tokens * 128u : 0u;
      const int splits = static_cast<int>(std::clamp<int64_t>((target + row_tiles / 2) / row_tiles,
                                                              1, std::min<int64_t>(8, s.k / 128)));
      const size_t smem = stages * (8192 + x_bytes) + 1024 + 16 * kStreamMaxStages;
      if (smem > 227 * 1024) continue;
      BENCH_CHECK(cudaFuncSetAttribute(TmaStreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
      const auto launch = [&](int l) {
        TmaStreamKernel<<<dim3(static_cast<unsigned>(row_tiles), static_cast<unsigned>(splits)),
                          160, smem, stream>>>(maps[l], x_map, s.k / 128, splits, stages, x_bytes,
                                               block_trace());
        BENCH_CHECK(cudaGetLastError());
      };
      const double us = Graph(launch, kLayers, stream);
      PrintRow(name, s.name, m, us, static_cast<double>(w[0].Bytes()));
      GraphTrace(name, s.name, m, launch, kLayers, stream);
    }
  }
}

void GemmRows(const Buffers& b, cudaStream_t stream) {
  const std::vector<Fp8WgmmaConfig> variants = Variants();
  Fp8WgmmaConfig clustered = fp8_gemm_wgmma_default_config();
  clustered.cluster_reduce = true;
  Fp8WgmmaConfig two_pass = fp8_gemm_wgmma_default_config();
  two_pass.cluster_reduce = false;
  two_pass.a16_cluster_reduce_tokens = 0;
  const std::vector<std::string> shapes = EnvList("PDSERVE_DECODE_SHAPES");
  const std::vector<std::string> tokens = EnvList("PDSERVE_DECODE_TOKENS");
  const std::vector<std::string> rows = EnvList("PDSERVE_DECODE_ROWS");
  for (const Shape& s : kShapes) {
    if (!Wanted(shapes, s.name)) continue;
    std::vector<Matrix> w;
    for (int l = 0; l < kLayers; ++l) w.push_back(MakeMatrix(s.n, s.k, 977u * l + 1));
    const double bytes = static_cast<double>(w[0].Bytes());
    const size_t w_bytes = static_cast<size_t>(s.n * s.k);
    // A path that refuses or faults on a probe call is reported on stderr and skipped (a fault
    // leaves the context unusable: the rows after it are lost, the ones before are printed).
    const auto row = [&](const std::string& name, int64_t m,
                         const std::function<cudaError_t(const Matrix&)>& call) {
      if (!Wanted(rows, name)) return;
      cudaError_t probe = call(w[0]);
      if (probe == cudaSuccess) probe = cudaStreamSynchronize(stream);
      if (probe != cudaSuccess) {
        std::fprintf(stderr, "%s %s m=%lld: %s\n", name.c_str(), s.name, static_cast<long long>(m),
                     cudaGetErrorString(probe));
        (void)cudaGetLastError();
        return;
      }
      const auto launch = [&](int l) { BENCH_CHECK(call(w[l])); };
      const double us = Graph(launch, kLayers, stream);
      PrintRow(name, s.name, m, us, bytes);
      GraphTrace(name, s.name, m, launch, kLayers, stream);
    };
    for (int64_t m : kTokens) {
      if (!Wanted(tokens, std::to_string(m))) continue;
      if (Wanted(rows, "read")) {
        const double read_us = Graph(
            [&](int l) { LaunchRead(w[l].w, w_bytes, b.sink, b.sms, stream); }, kLayers, stream);
        PrintRow("read", s.name, m, read_us, bytes);
        const double empty_us = Graph(
            [&](int) {
              EmptyKernel<<<1, 32, 0, stream>>>();
              BENCH_CHECK(cudaGetLastError());
            },
            kLayers, stream);
        PrintRow("empty", s.name, m, empty_us, 0);
      }
      StreamRows(s, w, m, rows, stream);
      const auto x = b.x;
      const auto out = b.out;
      row("fp8", m, [&](const Matrix& mw) {
        return fp8_gemm(x, m, s.k, s.k, mw.w, mw.scale, s.n, false, out, s.n, b.ws, b.ws_bytes,
                        stream);
      });
      row("w8a16", m, [&](const Matrix& mw) {
        return fp8_gemm_w8a16(x, m, s.k, s.k, mw.w, mw.scale, s.n, out, s.n, b.ws, b.ws_bytes,
                              stream);
      });
      // main's dispatch before this work (2026-12-04 14:19 UTC): mma.sync up to 8 (W8A8) / 32
      // (W8A16) tokens, else fp8_gemm_wgmma 1,4,264 with the reduce kernel.
      const Fp8WgmmaConfig before{1, 4, 264, false, false, false};
      row("fp8_before", m, [&](const Matrix& mw) {
        return m <= 8 ? fp8_gemm_mma(x, m, s.k, s.k, mw.w, mw.scale, s.n, false, out, s.n, b.ws,
                                     b.ws_bytes, stream)
                      : fp8_gemm_wgmma(x, m, s.k, s.k, mw.w, mw.scale, s.n, false, out, s.n, b.ws,
                                       b.ws_bytes, stream, before);
      });
      row("w8a16_before", m, [&](const Matrix& mw) {
        return m <= 32 ? fp8_gemm_w8a16_mma(x, m, s.k, s.k, mw.w, mw.scale, s.n, out, s.n, b.ws,
                                            b.ws_bytes, stream)
                       : fp8_gemm_w8a16_wgmma(x, m, s.k, s.k, mw.w, mw.scale, s.n, out, s.n, b.ws,
                                              b.ws_bytes, stream, before);
      });
      row("fp8_mma", m, [&](const Matrix& mw) {
        return fp8_gemm_mma(x, m, s.k, s.k, mw.w, mw.scale, s.n, false, out, s.n, b.ws, b.ws_bytes,
                            stream);
      });
      row("w8a16_mma", m, [&](const Matrix& mw) {
        return fp8_gemm_w8a16_mma(x, m, s.k, s.k, mw.w, mw.scale, s.n, out, s.n, b.ws, b.ws_bytes,
                                  stream);
      });
      // PDSERVE_DECODE_NO_CLUSTER set: no cluster_reduce rows (their tests failed).
      const bool no_cluster = std::getenv("PDSERVE_DECODE_NO_CLUSTER") != nullptr;
      std::vector<std::pair<std::string, Fp8WgmmaConfig>> configs = {{"_wgmma", two_pass}};
      if (!no_cluster) configs.push_back({"_wgmma_c", clustered});
      for (const Fp8WgmmaConfig& v : variants) {
        if (!no_cluster || !v.cluster_reduce) configs.push_back({"_v" + ConfigName(v), v});
      }
      for (const auto& named : configs) {
        const std::string& suffix = named.first;
        const Fp8WgmmaConfig& config = named.second;
        row("fp8" + suffix, m, [&](const Matrix& mw) {
          return fp8_gemm_wgmma(x, m, s.k, s.k, mw.w, mw.scale, s.n, false, out, s.n, b.ws,
                                b.ws_bytes, stream, config);
        });
        row("w8a16" + suffix, m, [&](const Matrix& mw) {
          return fp8_gemm_w8a16_wgmma(x, m, s.k, s.k, mw.w, mw.scale, s.n, out, s.n, b.ws,
                                      b.ws_bytes, stream, config);
        });
      }
    }
    for (const Matrix& mw : w) FreeMatrix(mw);
  }
}

// One dense GEMM of the layer: weights, input column offset and row stride, output column
// offset and row stride.
struct LayerGemm {
  Matrix w;
  int64_t x_offset = 0;
  int64_t x_stride = 0;
  int64_t out_offset = 0;
  int64_t out_stride = 0;
};

// The dense GEMMs of one V4-Flash CSA layer (engine/config.h sizes; see the file comment).
// fused: the nine projections of the layer input x (q_a, kv, the compressors' kv / gate, indexer
// weights, shared gate / up) as one GEMM over their rows stacked ([8256, 4096]), as the engine
// could call them with its weights concatenated at load, and o_a's 8 groups as one call;
// fused_q: also q_b_proj and the indexer's q_b_proj as one GEMM ([40960, 1024]).
std::vector<LayerGemm> MakeLayerGemms(uint32_t seed, bool fused, bool fused_q = false) {
  std::vector<LayerGemm> g;
  const auto add = [&](int64_t n, int64_t k, int64_t x_offset, int64_t x_stride, int64_t out_offset,
                       int64_t out_stride) {
    g.push_back({MakeMatrix(n, k, seed++), x_offset, x_stride, out_offset, out_stride});
  };
  if (fused) {
    add(8256, 4096, 0, 4096, 0, 8256);  // the nine projections of x, stacked
  } else {
    add(1024, 4096, 0, 4096, 0, 1024);  // q_a_proj
    add(512, 4096, 0, 4096, 0, 512);    // kv_proj
    add(1024, 4096, 0, 4096, 0, 1024);  // compressor kv_proj (overlapping: 2 x 512)
    add(1024, 4096, 0, 4096, 0, 1024);  // compressor gate_proj
    add(256, 4096, 0, 4096, 0, 256);    // indexer compressor kv_proj (2 x 128)
    add(256, 4096, 0, 4096, 0, 256);    // indexer compressor gate_proj
    add(64, 4096, 0, 4096, 0, 64);      // indexer weights_proj
    add(2048, 4096, 0, 4096, 0, 2048);  // shared expert gate
    add(2048, 4096, 0, 4096, 0, 2048);  // shared expert up
  }
  if (fused_q) {
    add(40960, 1024, 0, 1024, 0, 40960);  // q_b_proj and the indexer's q_b_proj, stacked
  } else {
    add(32768, 1024, 0, 1024, 0, 32768);  // q_b_proj (64 heads x 512)
    add(8192, 1024, 0, 1024, 0, 8192);    // indexer q_b_proj (64 x 128)
  }
  if (fused) {
    // o_a's 8 groups as one call over their stacked rows ([8192, 4096]): the bytes and work of a
    // grouped call (group g reads x columns 4096 g..; here every group reads columns 0..4095).
    add(8192, 4096, 0, 32768, 0, 8192);
  } else {
    for (int64_t group = 0; group < 8; ++group) {
      add(1024, 4096, group * 4096, 32768, group * 1024, 8192);  // o_a_proj, output group g
    }
  }
  add(4096, 8192, 0, 8192, 0, 4096);  // o_b_proj
  add(4096, 2048, 0, 2048, 0, 4096);  // shared expert down
  return g;
}

void LayerRows(const Buffers& b, cudaStream_t stream) {
  std::vector<std::vector<LayerGemm>> layers;
  std::vector<std::vector<LayerGemm>> fused_layers;
  std::vector<std::vector<LayerGemm>> fused_q_layers;
  double dense_bytes = 0.0;
  double fused_bytes = 0.0;
  for (int l = 0; l < kStepLayers; ++l) {
    layers.push_back(MakeLayerGemms(1000u * l + 3, false));
    fused_layers.push_back(MakeLayerGemms(1000u * l + 500, true));
    fused_q_layers.push_back(MakeLayerGemms(1000u * l + 700, true, true));
  }
  for (const LayerGemm& g : layers[0]) dense_bytes += static_cast<double>(g.w.Bytes());
  for (const LayerGemm& g : fused_layers[0]) fused_bytes += static_cast<double>(g.w.Bytes());
  double fused_q_bytes = 0.0;
  for (const LayerGemm& g : fused_q_layers[0]) fused_q_bytes += static_cast<double>(g.w.Bytes());
  // Routed experts, shared by the layers (each its own routing): gate+up [256, 4096, 4096] and
  // down [256, 4096, 2048].
  const Matrix gate_up = MakeMatrix(kExperts * 4096, 4096, 5u);
  const Matrix down = MakeMatrix(kExperts * 4096, 2048, 6u);
  const double expert_bytes =
      static_cast<double>(gate_up.Bytes() + down.Bytes()) / static_cast<double>(kExperts);
  std::vector<int32_t*> routing(kStepLayers);
  for (int32_t*& r : routing) r = DeviceAlloc<int32_t>(kTokens.back() * kTopK);
  auto* act =
      reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(kTokens.back() * kTopK * 4096));
  std::mt19937_64 rng(12345);
  // PDSERVE_DECODE_TOKENS limits layer mode too (the routings drawn are the same either way).
  const std::vector<std::string> layer_tokens = EnvList("PDSERVE_DECODE_TOKENS");
  // PDSERVE_DECODE_MOE_REUSE=0: the down call groups the picks again (MoeMmaGrouping::kAuto), as
  // the engine did before it reused the gate+up call's grouping.
  const char* reuse_env = std::getenv("PDSERVE_DECODE_MOE_REUSE");
  const MoeMmaGrouping moe_reuse = reuse_env != nullptr && std::string(reuse_env) == "0"
                                       ? MoeMmaGrouping::kAuto
                                       : MoeMmaGrouping::kReuse;
  for (int64_t m : kTokens) {
    const double distinct = RandomRoutings(m, kExperts, kTopK, routing, rng);
    if (!Wanted(layer_tokens, std::to_string(m))) continue;
    const double moe_bytes = distinct * expert_bytes;
    // part: "" (the whole step), "_dense", "_moe", "_dense_fused" (the dense GEMMs with the
    // projections of x fused), "_dense_fused_q" (and the two q_b projections).
    for (const std::string part : {"", "_dense", "_moe", "_dense_fused", "_dense_fused_q"}) {
      const bool dense = part != "_moe";
      const bool moe = part.empty() || part == "_moe";
      const std::vector<std::vector<LayerGemm>>* gemms = &layers;
      double dense_part_bytes = dense_bytes;
      if (part == "_dense_fused") {
        gemms = &fused_layers;
        dense_part_bytes = fused_bytes;
      } else if (part == "_dense_fused_q") {
        gemms = &fused_q_layers;
        dense_part_bytes = fused_q_bytes;
      }
      const double bytes = (dense ? dense_part_bytes : 0.0) + (moe ? moe_bytes : 0.0);
      for (const bool a16 : {true, false}) {
        ExpertWeights up_view;
        up_view.format = a16 ? ExpertFormat::kFp8W8A16 : ExpertFormat::kFp8;
        up_view.w = gate_up.w;
        up_view.scale = gate_up.scale;
        up_view.n_experts = kExperts;
        up_view.n = 4096;
        up_view.k = 4096;
        ExpertWeights down_view = up_view;
        down_view.w = down.w;
        down_view.scale = down.scale;
        down_view.k = 2048;
        const double us = Graph(
            [&](int l) {
              for (const LayerGemm& g : (*gemms)[l]) {
                if (!dense) break;
                const int64_t k = g.w.k;
                const __nv_bfloat16* x = b.x + g.x_offset;
                __nv_bfloat16* out = b.out + g.out_offset;
                BENCH_CHECK(a16 ? fp8_gemm_w8a16(x, m, k, g.x_stride, g.w.w, g.w.scale, g.w.n, out,
                                                 g.out_stride, b.ws, b.ws_bytes, stream)
                                : fp8_gemm(x, m, k, g.x_stride, g.w.w, g.w.scale, g.w.n, false, out,
                                           g.out_stride, b.ws, b.ws_bytes, stream));
              }
              if (!moe) return;
              BENCH_CHECK(moe_grouped_gemm(b.x, 4096, false, routing[l], nullptr, m, kTopK, up_view,
                                           false, b.out2, 8192, b.ws, b.ws_bytes, stream));
              // As the engine: the down call reuses the gate+up call's grouping.
              BENCH_CHECK(moe_grouped_gemm(act, 4096, true, routing[l], b.pick_w, m, kTopK,
                                           down_view, false, b.out2, 4096, b.ws, b.ws_bytes, stream,
                                           nullptr, moe_reuse));
            },
            kStepLayers, stream);
        PrintRow((a16 ? "layer_w8a16" : "layer_fp8") + part, "layer", m, us, bytes);
      }
      const size_t read_bytes = static_cast<size_t>(bytes) / 16 * 16;
      void* floor_buffer = DeviceAlloc<unsigned char>(read_bytes * kStepLayers);
      BENCH_CHECK(cudaMemset(floor_buffer, 1, read_bytes * kStepLayers));
      const double read_us = Graph(
          [&](int l) {
            LaunchRead(static_cast<unsigned char*>(floor_buffer) + l * read_bytes, read_bytes,
                       b.sink, b.sms, stream);
          },
          kStepLayers, stream);
      PrintRow("layer_read" + part, "layer", m, read_us, bytes);
      BENCH_CHECK(cudaFree(floor_buffer));
    }
  }
  for (int32_t* r : routing) BENCH_CHECK(cudaFree(r));
  BENCH_CHECK(cudaFree(act));
  FreeMatrix(gate_up);
  FreeMatrix(down);
  for (const auto* set : {&layers, &fused_layers, &fused_q_layers}) {
    for (const auto& layer : *set) {
      for (const LayerGemm& g : layer) FreeMatrix(g.w);
    }
  }
}

int Run(const std::string& mode) {
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Buffers b;
  BENCH_CHECK(cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0));
  b.sink = DeviceAlloc<uint4>(1);
  // The 2 GiB read floor (as gemm_bench.cu's "read" row: events, outside graphs).
  const size_t floor_bytes = size_t{2} << 30;
  void* src = DeviceAlloc<unsigned char>(floor_bytes);
  BENCH_CHECK(cudaMemset(src, 1, floor_bytes));
  const auto read_2g = [&] { LaunchRead(src, floor_bytes, b.sink, b.sms, stream); };
  for (int i = 0; i < 3; ++i) read_2g();
  PrintRow("read_2GiB", "-", 0, EventMedianMicros([](int) {}, read_2g, 10, stream),
           static_cast<double>(floor_bytes));
  BENCH_CHECK(cudaFree(src));

  const int64_t max_rows = kTokens.back() * kTopK;
  b.x = reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(max_rows * 32768));
  FillBf16(reinterpret_cast<uint16_t*>(b.x), max_rows * 32768, 99);
  b.out = reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(max_rows * 32768));
  b.out2 = reinterpret_cast<__nv_bfloat16*>(DeviceAlloc<uint16_t>(max_rows * 8192));
  b.pick_w = DeviceAlloc<float>(max_rows);
  FillScales<<<64, 256>>>(b.pick_w, nullptr, max_rows, 17);
  std::vector<Fp8WgmmaConfig> configs = Variants();
  configs.push_back(fp8_gemm_wgmma_default_config());
  configs.push_back(Fp8WgmmaConfig{});
  for (int64_t m : kTokens) {
    // The dense shapes and the layer's (the fused ones too).
    const std::pair<int64_t, int64_t> shapes[] = {{32768, 1024}, {4096, 8192}, {4096, 4096},
                                                  {4096, 2048},  {1024, 4096}, {8192, 1024},
                                                  {8256, 4096},  {8192, 4096}, {40960, 1024}};
    for (const auto& [n, k] : shapes) {
      b.ws_bytes = std::max(b.ws_bytes, fp8_gemm_workspace_bytes(m, n, k));
      for (const Fp8WgmmaConfig& c : configs) {
        b.ws_bytes = std::max(b.ws_bytes, fp8_gemm_wgmma_workspace_bytes(m, n, k, c));
      }
    }
    for (int64_t k : {int64_t{4096}, int64_t{2048}}) {
      ExpertWeights ew;
      ew.format = ExpertFormat::kFp8;
      ew.n_experts = kExperts;
      ew.n = 4096;
      ew.k = k;
      b.ws_bytes = std::max(b.ws_bytes, moe_grouped_gemm_workspace_bytes(m, kTopK, m * kTopK, ew));
    }
  }
  b.ws = DeviceAlloc<unsigned char>(b.ws_bytes);
  BENCH_CHECK(cudaDeviceSynchronize());
  if (mode == "gemm") GemmRows(b, stream);
  if (mode == "layer") LayerRows(b, stream);
  return 0;
}

}  // namespace
}  // namespace pdserve::kernels::cuda

// Argument: "gemm" (default) or "layer".
int main(int argc, char** argv) { return pdserve::kernels::cuda::Run(argc > 1 ? argv[1] : "gemm"); }
