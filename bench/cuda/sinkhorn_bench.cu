// Time of kernels/cuda/sinkhorn's kernels (SinkhornVariant: kAuto = one entry per lane at n = 4
// since 2026-12-06, kRowRegisters = rows in registers, kEntries, kSharedMemory) on the engine's
// shape (hc_mult n = 4, 20 iterations, one matrix per token) at decode batches and prefill chunk
// sizes: GraphMicros (bench_util.cuh), 16 launches on 16 matrices buffers in one CUDA graph, median
// of 20 replays / 16, so the figure is a launch's time inside a decode step's graph. The matrices
// are re-projected each replay (the kernel works in place; a projected matrix costs what a fresh
// one does: same operations). CSV:
//   matrices,n,iters,variant,us
// Usage: pdserve_sinkhorn_bench [matrices...] (default 1 8 32 128 1024 8192).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench/cuda/bench_util.cuh"
#include "kernels/cuda/sinkhorn.cuh"

int main(int argc, char** argv) {
  using namespace pdserve::kernels::cuda;
  std::vector<int64_t> counts = {1, 8, 32, 128, 1024, 8192};
  if (argc > 1) {
    counts.clear();
    for (int i = 1; i < argc; ++i) counts.push_back(std::atoll(argv[i]));
  }
  constexpr int64_t kN = 4;
  constexpr int64_t kIters = 20;
  constexpr int kLayers = 16;
  constexpr float kEps = 1e-6f;
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  const struct {
    const char* name;
    SinkhornVariant variant;
  } variants[] = {{"auto", SinkhornVariant::kAuto},
                  {"entries", SinkhornVariant::kEntries},
                  {"row_registers", SinkhornVariant::kRowRegisters},
                  {"shared_memory", SinkhornVariant::kSharedMemory}};
  std::printf("matrices,n,iters,variant,us\n");
  for (const int64_t count : counts) {
    const size_t floats = static_cast<size_t>(count * kN * kN);
    std::vector<float> host(floats);
    for (size_t i = 0; i < floats; ++i)
      host[i] = static_cast<float>((i * 2654435761u) % 1000) / 250.0f - 2.0f;
    std::vector<float*> buffers(kLayers);
    for (float*& b : buffers) {
      b = DeviceAlloc<float>(floats);
      BENCH_CHECK(cudaMemcpy(b, host.data(), floats * sizeof(float), cudaMemcpyHostToDevice));
    }
    for (const auto& v : variants) {
      const double us = GraphMicros(
          [&](int l) {
            BENCH_CHECK(sinkhorn_project(buffers[static_cast<size_t>(l)], count, kN, kIters, kEps,
                                         stream, v.variant));
          },
          kLayers, 20, stream);
      std::printf("%lld,%lld,%lld,%s,%.2f\n", static_cast<long long>(count),
                  static_cast<long long>(kN), static_cast<long long>(kIters), v.name, us);
      std::fflush(stdout);
    }
    for (float* b : buffers) BENCH_CHECK(cudaFree(b));
  }
  return 0;
}
