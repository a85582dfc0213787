// Timing helpers shared by the CUDA benchmarks (cuda_bench.cu, gemm_bench.cu): checked CUDA
// calls, device allocation, random bf16 fill, the L2 flush, the read floor, event and CUDA-graph
// medians. Benchmark-only; not thread-safe.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/block_trace.h"
#include "kernels/cuda/fp8_gemm.cuh"

// Not in an unnamed namespace: each benchmark is one translation unit, and a helper it does not
// use must not warn.
namespace pdserve::kernels::cuda {

#define BENCH_CHECK(expr)                                                                       \
  do {                                                                                          \
    const cudaError_t bench_status = (expr);                                                    \
    if (bench_status != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(bench_status)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

// 32 well-mixed bits from an element index and a seed.
__device__ __forceinline__ uint32_t HashIndex(size_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}

// Random bf16 in about [-1, 1) from a hash of the index (never all zeros: METHOD.md).
__device__ __forceinline__ uint16_t RandomBf16(size_t i, uint32_t seed) {
  const uint32_t h = HashIndex(i, seed);
  const float f = static_cast<float>(h & 0xFFFF) / 32768.0f - 1.0f;
  return static_cast<uint16_t>(__float_as_uint(f) >> 16);
}

// p[i] = RandomBf16(i, seed), eight elements per 16-byte store (the bench's pools are tens of GB;
// `p` 16-byte aligned, as cudaMalloc gives), the tail of n % 8 one by one.
__global__ void FillRandomBf16(uint16_t* p, size_t n, uint32_t seed) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t u = blockIdx.x * size_t{blockDim.x} + threadIdx.x; u < n / 8; u += stride) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = RandomBf16(8 * u + 2 * j, seed) |
             (static_cast<uint32_t>(RandomBf16(8 * u + 2 * j + 1, seed)) << 16);
    }
    reinterpret_cast<uint4*>(p)[u] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  for (size_t i = n / 8 * 8 + blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    p[i] = RandomBf16(i, seed);
  }
}

void FillBf16(uint16_t* p, size_t n, uint32_t seed) {
  FillRandomBf16<<<1024, 256>>>(p, n, seed);
  BENCH_CHECK(cudaGetLastError());
}

// Random bytes with the e4m3 NaN codes replaced (hash of the index; never all zeros).
__global__ void FillWeightBytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint8_t b = static_cast<uint8_t>(HashIndex(i, seed));
    if ((b & 0x7F) == 0x7F) b ^= 1;
    p[i] = b;
  }
}

// Scales near 1 (fp32: 1 + small; ue8m0: 126..128).
__global__ void FillScales(float* f, uint8_t* e8, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint32_t h = (static_cast<uint32_t>(i) * 2246822519u) ^ seed;
    if (f != nullptr) f[i] = 0.75f + static_cast<float>(h % 1024) / 2048.0f;
    if (e8 != nullptr) e8[i] = static_cast<uint8_t>(126 + h % 3);
  }
}

// Random FP8 weight bytes (FillWeightBytes) on the device.
uint8_t* RandomWeights(size_t bytes, uint32_t seed) {
  uint8_t* p = DeviceAlloc<uint8_t>(bytes);
  FillWeightBytes<<<2048, 256>>>(p, bytes, seed);
  BENCH_CHECK(cudaGetLastError());
  return p;
}

// V4-Flash's dense GEMM shapes (engine/config.h: hidden 4096, q_lora 1024, 64 heads x 512,
// o_groups 8 x o_lora 1024, experts of 2048): wq_b, wo_b, and one expert's gate+up (w13) and down
// (w2) as plain GEMMs; n output rows, k the reduction.
struct DenseShape {
  const char* name;
  int64_t n;
  int64_t k;
};
const std::vector<DenseShape> kV4FlashShapes = {
    {"wq_b", 32768, 1024}, {"wo_b", 4096, 8192}, {"w13", 4096, 4096}, {"w2", 4096, 2048}};

// A random top-k routing of `tokens` tokens over `experts` experts (distinct per token) for each
// device buffer of `per_layer` ([tokens, top_k] int32 each); returns the mean number of distinct
// experts touched.
double RandomRoutings(int64_t tokens, int64_t experts, int64_t top_k,
                      const std::vector<int32_t*>& per_layer, std::mt19937_64& rng) {
  double distinct = 0.0;
  std::vector<int32_t> order(experts);
  for (int32_t* layer : per_layer) {
    std::vector<int32_t> host;
    std::set<int32_t> used;
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(order.begin(), order.end(), 0);
      for (int64_t j = 0; j < top_k; ++j) {
        std::swap(order[j], order[j + rng() % (experts - j)]);
        host.push_back(order[j]);
        used.insert(order[j]);
      }
    }
    distinct += static_cast<double>(used.size()) / static_cast<double>(per_layer.size());
    BENCH_CHECK(cudaMemcpy(layer, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  }
  return distinct;
}

// fp8_gemm_wgmma configs from "w,s,t[,c[,x[,r[,a[,i[,p[,k[,m[,R[,A]]]]]]]]]];..." (warpgroups,
// stages, target blocks, then the flags cluster_reduce, smem_scales, a16_register_weights,
// alternate_turns, two_in_flight, split_tokens (p), stagger_k, multicast_activations as 0 | 1, then
// max_registers 96 | 128 (anything else: 0), then a16_cluster_reduce_tokens (0-64); missing ones
// 0, so unlike PDSERVE_FP8_WGMMA a variant without A has no a16_cluster_reduce_tokens: the
// dispatch's default is "0,0,264,0,1,1,0,0,0,0,0,0,16"); malformed entries are skipped.
std::vector<Fp8WgmmaConfig> ParseWgmmaConfigs(const std::string& text) {
  std::vector<Fp8WgmmaConfig> v;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find(';', at), text.size());
    Fp8WgmmaConfig c;
    int cluster = 0;
    int scales = 0;
    int reg = 0;
    int alternate = 0;
    int in_flight = 0;
    int split = 0;
    int stagger = 0;
    int multicast = 0;
    int max_registers = 0;
    int a16_cluster = 0;
    if (std::sscanf(text.substr(at, end - at).c_str(), "%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d",
                    &c.warpgroups, &c.stages, &c.target_blocks, &cluster, &scales, &reg, &alternate,
                    &in_flight, &split, &stagger, &multicast, &max_registers, &a16_cluster) >= 3) {
      c.a16_cluster_reduce_tokens = a16_cluster >= 0 && a16_cluster <= 64 ? a16_cluster : 0;
      c.max_registers = max_registers == 96 || max_registers == 128 ? max_registers : 0;
      c.multicast_activations = multicast == 1;
      c.split_tokens = split == 1;
      c.stagger_k = stagger == 1;
      c.alternate_turns = alternate == 1;
      c.two_in_flight = in_flight == 1;
      c.a16_register_weights = reg == 1;
      c.cluster_reduce = cluster == 1;
      c.smem_scales = scales == 1;
      v.push_back(c);
    }
    at = end + 1;
  }
  return v;
}

// Reads `n` 16-byte units (the clean flush: afterwards L2 holds only lines of this buffer, none
// dirty). The XOR is stored only when it equals a value that random fill never gives, so the
// reads are not optimized away.
__global__ void ReadAll(const uint4* p, size_t n, uint4* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) *sink = make_uint4(x, x, x, x);
}

// Reads `n` 16-byte units with four loads in flight per thread: the floor for a kernel that must
// read that many bytes (the same timing, the same launch, none of the kernel's work; see the
// "_read" rows of Run). Only one word of each unit is folded in, so the compiler may load just
// that word; a warp still touches every 32-byte sector of its 512 contiguous bytes, so the DRAM
// traffic is the whole range (the figures in docs/perf.md, 2026-12-03, are of this version).
__global__ void __launch_bounds__(512) ReadFloor(const uint4* p, size_t n, uint4* sink) {
  uint32_t x = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i];
    const uint4 b = p[i + stride];
    const uint4 c = p[i + 2 * stride];
    const uint4 d = p[i + 3 * stride];
    x ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) x ^= p[i].x;
  if (x == 0x9E3779B9u) *sink = make_uint4(x, x, x, x);
}

// What runs before each timed launch so that no input is served from L2: `write` overwrites a
// 256 MiB buffer (L2 is then full of dirty lines of it, written back while the timed kernel
// reads: extra HBM traffic charged to that kernel); with PDSERVE_BENCH_FLUSH=clean a second
// 256 MiB buffer is then read, so L2 holds only clean lines when the timing starts (as Nsight
// Compute's default cache control leaves it).
struct Flush {
  void* write = nullptr;
  void* read = nullptr;  // nullptr: write only
  size_t bytes = 0;
  uint4* sink = nullptr;
  void Run(int i, cudaStream_t stream) const {
    BENCH_CHECK(cudaMemsetAsync(write, i & 0xFF, bytes, stream));
    if (read != nullptr) {
      ReadAll<<<1024, 256, 0, stream>>>(static_cast<const uint4*>(read), bytes / 16, sink);
      BENCH_CHECK(cudaGetLastError());
    }
  }
};

// Median over `reps` runs of `timed` on `stream`, each after `before(i)` and timed alone by CUDA
// events, in microseconds.
template <typename Before, typename Timed>
double EventMedianMicros(Before before, Timed timed, int reps, cudaStream_t stream) {
  cudaEvent_t start;
  cudaEvent_t stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    before(i);
    BENCH_CHECK(cudaEventRecord(start, stream));
    timed();
    BENCH_CHECK(cudaEventRecord(stop, stream));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  return 1000.0 * times[times.size() / 2];
}

// Median time of `reps` launches of `fn` on `stream`, each after `flush`.
template <typename Fn>
double MedianMicros(Fn fn, int reps, const Flush& flush, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) fn();
  return EventMedianMicros([&](int i) { flush.Run(i, stream); }, fn, reps, stream);
}

// Median over `reps` replays of a graph holding launch(0), ..., launch(layers - 1) on `stream`,
// divided by `layers`: the time per launch inside a decode step's graph.
double GraphMicros(const std::function<void(int)>& launch, int layers, int reps,
                   cudaStream_t stream) {
  for (int l = 0; l < layers; ++l) launch(l);  // first calls outside capture (kernel attributes)
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < layers; ++l) launch(l);
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) BENCH_CHECK(cudaGraphLaunch(exec, stream));
  const double us = EventMedianMicros(
      [](int) {}, [&] { BENCH_CHECK(cudaGraphLaunch(exec, stream)); }, reps, stream);
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  return us / layers;
}

// PDSERVE_BLOCK_TRACE=<file>: GraphTrace appends the block timelines (kernels/cuda/block_trace.h)
// of the last two launches of a graph like GraphMicros's (layers - 2 and layers - 1, replayed
// after one warm replay, so each runs behind its predecessor as in the timing) to <file>, one line
// per block: "row,shape,tokens,launch,block,start,dependency,end,sm,setup,first_data,last_data,
// loop_done,extra0,extra1,extra2,extra3" (launch 0 / 1; times in ns since the earliest start of the
// two, -1 where the kernel did not mark it). Nothing when the variable is unset or the kernels are
// not instrumented.
inline void GraphTrace(const std::string& row, const std::string& shape, int64_t tokens,
                       const std::function<void(int)>& launch, int layers, cudaStream_t stream) {
  static FILE* const file = [] {
    const char* path = std::getenv("PDSERVE_BLOCK_TRACE");
    return path != nullptr && *path != '\0' ? std::fopen(path, "a") : nullptr;
  }();
  if (file == nullptr || layers < 2) return;
  constexpr int64_t kCapacity = 16384;  // blocks per traced launch
  constexpr int64_t kSlots = kBlockTraceSlots;
  static uint64_t* slots = nullptr;
  if (slots == nullptr) BENCH_CHECK(cudaMalloc(&slots, 2 * kCapacity * kSlots * sizeof(uint64_t)));
  cudaGraph_t graph;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < layers; ++l) {
    const int traced = l - (layers - 2);
    set_block_trace(traced >= 0 ? slots + traced * kCapacity * kSlots : nullptr, kCapacity);
    launch(l);
  }
  set_block_trace(nullptr, 0);
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  BENCH_CHECK(cudaGraphLaunch(exec, stream));
  BENCH_CHECK(cudaMemsetAsync(slots, 0, 2 * kCapacity * kSlots * sizeof(uint64_t), stream));
  BENCH_CHECK(cudaGraphLaunch(exec, stream));
  std::vector<uint64_t> host(2 * kCapacity * kSlots);
  BENCH_CHECK(cudaMemcpyAsync(host.data(), slots, host.size() * sizeof(uint64_t),
                              cudaMemcpyDeviceToHost, stream));
  BENCH_CHECK(cudaStreamSynchronize(stream));
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  uint64_t t0 = UINT64_MAX;
  for (int64_t i = 0; i < 2 * kCapacity; ++i) {
    if (host[kSlots * i] != 0) t0 = std::min(t0, host[kSlots * i]);
  }
  for (int64_t i = 0; i < 2 * kCapacity; ++i) {
    const uint64_t* b = &host[kSlots * i];
    if (b[0] == 0) continue;
    const auto rel = [t0](uint64_t t) { return t != 0 ? static_cast<long long>(t - t0) : -1LL; };
    std::fprintf(
        file, "%s,%s,%lld,%lld,%lld,%lld,%lld,%lld,%llu,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld\n",
        row.c_str(), shape.c_str(), static_cast<long long>(tokens),
        static_cast<long long>(i / kCapacity), static_cast<long long>(i % kCapacity), rel(b[0]),
        rel(b[1]), rel(b[2]), static_cast<unsigned long long>(b[3]), rel(b[4]), rel(b[5]),
        rel(b[6]), rel(b[7]), rel(b[8]), rel(b[9]), rel(b[10]), rel(b[11]));
  }
  std::fflush(file);
}

}  // namespace pdserve::kernels::cuda
