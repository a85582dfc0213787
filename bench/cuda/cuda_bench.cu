// Times the CUDA lightning indexer (scores + top-k) and sparse decode attention at DeepSeek-V4
// Flash shapes against the measured device-to-device copy bandwidth. Prints CSV rows:
//   kernel,batch,context,entries,median_us,bytes,flops
// (entries: indexer keys or attended rows per request; bytes: inputs read once + outputs
// written once; flops: multiply-adds x 2). bench/cuda/compare.py adds PyTorch and the table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/indexer.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {
namespace {

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

// Random bf16 in about [-1, 1) from a hash of the index (never all zeros: METHOD.md).
__global__ void FillRandomBf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float f = static_cast<float>(h & 0xFFFF) / 32768.0f - 1.0f;
    p[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
  }
}

void FillBf16(uint16_t* p, size_t n, uint32_t seed) {
  FillRandomBf16<<<1024, 256>>>(p, n, seed);
  BENCH_CHECK(cudaGetLastError());
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
  void Run(int i) const {
    BENCH_CHECK(cudaMemsetAsync(write, i & 0xFF, bytes));
    if (read != nullptr) {
      ReadAll<<<1024, 256>>>(static_cast<const uint4*>(read), bytes / 16, sink);
      BENCH_CHECK(cudaGetLastError());
    }
  }
};

// Median time of `reps` launches of `fn`, each after `flush`.
template <typename Fn>
double MedianMicros(Fn fn, int reps, const Flush& flush) {
  cudaEvent_t start;
  cudaEvent_t stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    flush.Run(i);
    BENCH_CHECK(cudaEventRecord(start));
    fn();
    BENCH_CHECK(cudaEventRecord(stop));
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

std::vector<int32_t> Iota(int64_t n, int64_t stride, int64_t rows) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>((i % rows) * stride + i / rows);
  return v;
}

int32_t* Upload(const std::vector<int32_t>& host) {
  int32_t* d = DeviceAlloc<int32_t>(host.size());
  BENCH_CHECK(cudaMemcpy(d, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

// only_batch / only_context: 0 runs every size, else only that one (for profiling one case).
int Run(int64_t only_batch, int64_t only_context) {
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Flush flush;
  flush.bytes = size_t{256} << 20;
  flush.write = DeviceAlloc<unsigned char>(flush.bytes);
  const char* flush_mode = std::getenv("PDSERVE_BENCH_FLUSH");
  if (flush_mode != nullptr && std::string(flush_mode) == "clean") {
    flush.read = DeviceAlloc<unsigned char>(flush.bytes);
    BENCH_CHECK(cudaMemset(flush.read, 0x5A, flush.bytes));
    flush.sink = DeviceAlloc<uint4>(1);
  }

  // Copy roofline: bytes read + bytes written over the time of one large device-to-device copy.
  const size_t copy_bytes = size_t{2} << 30;
  void* src = DeviceAlloc<unsigned char>(copy_bytes);
  void* dst = DeviceAlloc<unsigned char>(copy_bytes);
  BENCH_CHECK(cudaMemset(src, 1, copy_bytes));
  const double copy_us = MedianMicros(
      [&] { BENCH_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 10,
      flush);
  std::printf("copy,0,0,0,%.3f,%zu,0\n", copy_us, 2 * copy_bytes);
  BENCH_CHECK(cudaFree(src));
  BENCH_CHECK(cudaFree(dst));

  constexpr int64_t kRate = 4;  // CSA compression
  constexpr int64_t kHcaRate = 128;
  constexpr int64_t kTopK = 512;
  constexpr int64_t kWindow = 128;
  constexpr int64_t kPage = 64;
  constexpr int64_t kHeads = 64;
  const std::vector<int64_t> batches = {1, 32, 128};
  const std::vector<int64_t> contexts = {4096, 32768, 131072};
  const int64_t max_batch = 128;
  const int64_t max_keys = 131072 / kRate;
  const int64_t pages_per_request = max_keys / kPage;

  // Indexer keys and compressed KV for the largest case; requests own interleaved pages.
  uint16_t* index_pool = DeviceAlloc<uint16_t>(max_batch * max_keys * kIndexHeadDim);
  uint16_t* kv_pool = DeviceAlloc<uint16_t>(max_batch * max_keys * kSparseHeadDim);
  uint16_t* window_pool = DeviceAlloc<uint16_t>(max_batch * kWindow * kSparseHeadDim);
  uint16_t* q_index = DeviceAlloc<uint16_t>(max_batch * kIndexHeads * kIndexHeadDim);
  uint16_t* q = DeviceAlloc<uint16_t>(max_batch * kHeads * kSparseHeadDim);
  FillBf16(index_pool, max_batch * max_keys * kIndexHeadDim, 1);
  FillBf16(kv_pool, max_batch * max_keys * kSparseHeadDim, 2);
  FillBf16(window_pool, max_batch * kWindow * kSparseHeadDim, 3);
  FillBf16(q_index, max_batch * kIndexHeads * kIndexHeadDim, 4);
  FillBf16(q, max_batch * kHeads * kSparseHeadDim, 5);
  std::vector<float> host_w(max_batch * kIndexHeads);
  for (size_t i = 0; i < host_w.size(); ++i) host_w[i] = static_cast<float>(i % 13) / 13.0f - 0.4f;
  float* w = DeviceAlloc<float>(host_w.size());
  BENCH_CHECK(cudaMemcpy(w, host_w.data(), host_w.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> host_sinks(kHeads, 0.5f);
  float* sinks = DeviceAlloc<float>(kHeads);
  BENCH_CHECK(cudaMemcpy(sinks, host_sinks.data(), kHeads * 4, cudaMemcpyHostToDevice));
  int32_t* page_table = Upload(Iota(max_batch * pages_per_request, max_batch, pages_per_request));
  float* scores = DeviceAlloc<float>(max_batch * max_keys);
  int32_t* visible = DeviceAlloc<int32_t>(max_batch);
  int32_t* picks = DeviceAlloc<int32_t>(max_batch * kTopK);
  std::vector<int32_t> host_window_page(max_batch);
  for (int64_t b = 0; b < max_batch; ++b) host_window_page[b] = static_cast<int32_t>(b);
  int32_t* window_page = Upload(host_window_page);
  int32_t* window_len = Upload(std::vector<int32_t>(max_batch, kWindow));
  // CSA indices: spread over the visible entries (every (keys / 512)-th), as a top-k would be.
  for (int64_t context : contexts) {
    if (only_context != 0 && context != only_context) continue;
    const int64_t keys = context / kRate;
    int32_t* n_keys = Upload(std::vector<int32_t>(max_batch, static_cast<int32_t>(keys)));
    int32_t* positions = Upload(std::vector<int32_t>(max_batch, static_cast<int32_t>(context - 1)));
    std::vector<int32_t> host_indices(max_batch * kTopK);
    for (size_t i = 0; i < host_indices.size(); ++i) {
      host_indices[i] = static_cast<int32_t>((i % kTopK) * (keys / kTopK) + (i / kTopK) % 3);
    }
    int32_t* indices = Upload(host_indices);
    int32_t* n_hca =
        Upload(std::vector<int32_t>(max_batch, static_cast<int32_t>(context / kHcaRate)));
    for (int64_t batch : batches) {
      if (only_batch != 0 && batch != only_batch) continue;
      IndexerParams ip;
      ip.q = reinterpret_cast<const __nv_bfloat16*>(q_index);
      ip.weights = w;
      ip.key_pool = reinterpret_cast<const __nv_bfloat16*>(index_pool);
      ip.page_table = page_table;
      ip.page_table_stride = pages_per_request;
      ip.page_size = kPage;
      ip.n_keys = n_keys;
      ip.positions = positions;
      ip.rate = kRate;
      ip.batch = batch;
      ip.max_keys = keys;
      ip.softmax_scale = 0.0883883f;
      const double us = MedianMicros(
          [&] { BENCH_CHECK(lightning_indexer(ip, kTopK, scores, visible, picks, nullptr)); }, 20,
          flush);
      const double bytes = batch * (keys * kIndexHeadDim * 2.0 + kIndexHeads * kIndexHeadDim * 2.0 +
                                    kIndexHeads * 4.0 + kTopK * 4.0);
      const double flops = 2.0 * batch * keys * kIndexHeads * kIndexHeadDim;
      std::printf("indexer,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", static_cast<long long>(batch),
                  static_cast<long long>(context), static_cast<long long>(keys), us, bytes, flops);
      // The two stages alone: scores (keys in, fp32 scores out) and top-k (scores in, picks out).
      const double scores_us = MedianMicros(
          [&] { BENCH_CHECK(indexer_scores(ip, scores, visible, nullptr)); }, 20, flush);
      std::printf("indexer_scores,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", static_cast<long long>(batch),
                  static_cast<long long>(context), static_cast<long long>(keys), scores_us,
                  batch * (keys * kIndexHeadDim * 2.0 + keys * 4.0), flops);
      const double topk_us = MedianMicros(
          [&] { BENCH_CHECK(top_k(scores, batch, keys, visible, kTopK, picks, nullptr)); }, 20,
          flush);
      std::printf("top_k,%lld,%lld,%lld,%.3f,%.0f,0\n", static_cast<long long>(batch),
                  static_cast<long long>(context), static_cast<long long>(keys), topk_us,
                  batch * (keys * 4.0 + kTopK * 4.0));

      for (bool csa : {true, false}) {
        SparseDecodeParams sp;
        sp.q = reinterpret_cast<const __nv_bfloat16*>(q);
        sp.batch = batch;
        sp.heads = kHeads;
        sp.window_pool = reinterpret_cast<const __nv_bfloat16*>(window_pool);
        sp.window_page = window_page;
        sp.window_len = window_len;
        sp.window_size = kWindow;
        sp.kv_pool = reinterpret_cast<const __nv_bfloat16*>(kv_pool);
        sp.page_table = page_table;
        sp.page_table_stride = pages_per_request;
        sp.page_size = kPage;
        sp.n_compressed = csa ? n_keys : n_hca;
        sp.indices = csa ? indices : nullptr;
        sp.compressed_slots = csa ? kTopK : context / kHcaRate;
        sp.sinks = sinks;
        sp.softmax_scale = 0.0441942f;
        const int64_t entries = kWindow + sp.compressed_slots;
        sp.entries_per_split = SparseDecodeEntriesPerSplit(batch, kHeads, entries, sms);
        const size_t ws_bytes = SparseDecodeWorkspaceBytes(sp);
        void* ws = DeviceAlloc<unsigned char>(ws_bytes);
        __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(
            DeviceAlloc<uint16_t>(batch * kHeads * kSparseHeadDim));
        const double attn_us = MedianMicros(
            [&] { BENCH_CHECK(sparse_decode_attention(sp, ws, ws_bytes, out, nullptr)); }, 20,
            flush);
        const double attn_bytes =
            batch * (entries * kSparseHeadDim * 2.0 + 2.0 * kHeads * kSparseHeadDim * 2.0);
        const double attn_flops = 4.0 * batch * kHeads * entries * kSparseHeadDim;
        std::printf("%s,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", csa ? "csa_attention" : "hca_attention",
                    static_cast<long long>(batch), static_cast<long long>(context),
                    static_cast<long long>(entries), attn_us, attn_bytes, attn_flops);
        BENCH_CHECK(cudaFree(ws));
        BENCH_CHECK(cudaFree(out));
      }
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace pdserve::kernels::cuda

// Usage: pdserve_cuda_bench [batch context]  (both 0 or absent: every size).
int main(int argc, char** argv) {
  const int64_t batch = argc > 2 ? std::atoll(argv[1]) : 0;
  const int64_t context = argc > 2 ? std::atoll(argv[2]) : 0;
  return pdserve::kernels::cuda::Run(batch, context);
}
