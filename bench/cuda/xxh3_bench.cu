// Throughput of kernels/cuda/xxh3 (XXH3-64 of a batch of device pages) against the read floor of
// the same bytes (bench_util.cuh's ReadFloor over the pages' contiguous range: what any kernel
// that reads them must spend), L2 flushed before each timed launch (256 MiB written), medians of
// 20 launches by CUDA events. Page sets: uniform batches of 16 KiB (indexer-key pages), 64 KiB
// (compressed-entry pages), 128 KiB (window pages), 1 MiB and 4 MiB, about 256 MiB each, and the
// 32K and 128K-token prompts' page lists of bench/kvtransfer/ipc_transfer_bench (the same shapes,
// written out here: 8 V4-Flash layers). CSV on stdout:
//   set,pages,mean_page_bytes,total_bytes,xxh3_us,xxh3_GBps,floor_us,floor_GBps,share_of_floor
// Usage: xxh3_bench [set...] (default: all).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/cuda/bench_util.cuh"
#include "kernels/cuda/xxh3.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr uint64_t kAlign = 256;

struct PageSet {
  std::string name;
  std::vector<uint64_t> lengths;
};

std::vector<uint64_t> Uniform(uint64_t page_bytes, uint64_t total) {
  return std::vector<uint64_t>(total / page_bytes, page_bytes);
}

// The page lengths of one prompt, as bench/kvtransfer/ipc_transfer_bench.cc's PromptPages.
std::vector<uint64_t> Prompt(uint64_t tokens) {
  std::vector<uint64_t> pages;
  auto entries = [&](uint64_t n, uint64_t entry_bytes) {
    for (uint64_t e = 0; e < n; e += 64)
      pages.push_back(std::min<uint64_t>(64, n - e) * entry_bytes);
  };
  for (int layer = 0; layer < 8; ++layer) {
    const bool csa = layer % 2 == 0;
    const uint64_t rate = csa ? 4 : 128;
    pages.push_back(128 * 512 * 2);
    entries(tokens / rate, 512 * 2);
    if (csa) entries(tokens / rate, 128 * 2);
    pages.push_back((csa ? 2 * rate : rate) * 2 * 512 * 2);
  }
  return pages;
}

void Run(const PageSet& set, const Flush& flush, uint4* sink, cudaStream_t stream) {
  std::vector<Xxh3Page> host;
  uint64_t at = 0;
  uint64_t total = 0;
  for (uint64_t n : set.lengths) {
    host.push_back({reinterpret_cast<const void*>(at), n});
    at += (n + kAlign - 1) / kAlign * kAlign;
    total += n;
  }
  uint8_t* bytes = DeviceAlloc<uint8_t>(at);
  FillWeightBytes<<<2048, 256, 0, stream>>>(bytes, at, 54);
  BENCH_CHECK(cudaGetLastError());
  for (Xxh3Page& p : host) p.data = bytes + reinterpret_cast<uintptr_t>(p.data);
  Xxh3Page* pages = DeviceAlloc<Xxh3Page>(host.size());
  uint64_t* hashes = DeviceAlloc<uint64_t>(host.size());
  BENCH_CHECK(
      cudaMemcpy(pages, host.data(), host.size() * sizeof(Xxh3Page), cudaMemcpyHostToDevice));
  const int64_t n = static_cast<int64_t>(host.size());
  const double us = MedianMicros([&] { BENCH_CHECK(xxh3_64_pages(pages, n, hashes, stream)); }, 20,
                                 flush, stream);
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double floor_us = MedianMicros(
      [&] {
        ReadFloor<<<4 * sms, 512, 0, stream>>>(reinterpret_cast<const uint4*>(bytes), at / 16,
                                               sink);
        BENCH_CHECK(cudaGetLastError());
      },
      20, flush, stream);
  std::printf("%s,%zu,%.0f,%llu,%.1f,%.1f,%.1f,%.1f,%.2f\n", set.name.c_str(), host.size(),
              static_cast<double>(total) / host.size(), static_cast<unsigned long long>(total), us,
              total / (us * 1e3), floor_us, at / (floor_us * 1e3), floor_us / us);
  std::fflush(stdout);
  BENCH_CHECK(cudaFree(bytes));
  BENCH_CHECK(cudaFree(pages));
  BENCH_CHECK(cudaFree(hashes));
}

}  // namespace
}  // namespace pdserve::kernels::cuda

int main(int argc, char** argv) {
  using namespace pdserve::kernels::cuda;
  constexpr uint64_t kTotal = 256ull << 20;
  const std::vector<PageSet> sets = {
      {"16KiB", Uniform(16 << 10, kTotal)},   {"64KiB", Uniform(64 << 10, kTotal)},
      {"128KiB", Uniform(128 << 10, kTotal)}, {"1MiB", Uniform(1 << 20, kTotal)},
      {"4MiB", Uniform(4 << 20, kTotal)},     {"prompt32K", Prompt(32768)},
      {"prompt128K", Prompt(131072)}};
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreate(&stream));
  Flush flush;
  flush.bytes = 256ull << 20;
  flush.write = DeviceAlloc<uint8_t>(flush.bytes);
  uint4* sink = DeviceAlloc<uint4>(1);
  flush.sink = sink;
  std::printf(
      "set,pages,mean_page_bytes,total_bytes,xxh3_us,xxh3_GBps,floor_us,floor_GBps,"
      "share_of_floor\n");
  for (const PageSet& set : sets) {
    bool chosen = argc == 1;
    for (int i = 1; i < argc; ++i) chosen |= set.name == argv[i];
    if (chosen) Run(set, flush, sink, stream);
  }
  return 0;
}
