// Times the CUDA lightning indexer (scores + top-k) and sparse decode attention at DeepSeek-V4
// Flash shapes against the measured device-to-device copy bandwidth. Prints CSV rows:
//   kernel,batch,context,entries,median_us,bytes,flops
// (entries: indexer keys or attended rows per request; bytes: inputs read once + outputs
// written once; flops: multiply-adds x 2). bench/cuda/compare.py adds PyTorch and the table.
//
// Two timings (PDSERVE_BENCH_TIMING):
// - launch (default): CUDA events around one launch, after a flush of L2 (PDSERVE_BENCH_FLUSH);
//   median of 20. Every launch pays its own launch latency, first bytes and drain alone.
// - graph: one launch per layer of kLayers layers, each layer with its own pools, queries and
//   windows (as a decode step's graph holds one launch per layer, each over that layer's state),
//   captured in one CUDA graph; median over 20 replays of (replay time / kLayers). No flush: the
//   layers' inputs together exceed L2 several times at batch >= 32 (so each launch reads from HBM
//   what the launches between evicted); at batch 1 and a short context they fit in L2, and the
//   launch table is the one to read there.
// Inputs are allocated for one context and one phase at a time (indexer rows, then attention
// rows) and freed after; a phase whose inputs do not fit the device's free memory is skipped with
// a "skipped:" line on stderr (FitsDeviceMemory).
// PDSERVE_BENCH_ONLY=attention: only the attention rows (and their read floors); the indexer's
// pools are not allocated.
// PDSERVE_BLOCK_TRACE=<file> (graph timing): each attention row's split-kernel block timelines,
// and the select top-k rows' (top_k_select / _prefetch / _quantile, whole), appended to <file>
// (bench_util.cuh's GraphTrace; shape "<batch>x<context>", tokens: entries, keys a row).
// PDSERVE_BENCH_ONLY=indexer: only the indexer and top-k rows (and their read floors); the
// attention's pools are not allocated.
// Attention rows, each at the split size SparseDecodeEntriesPerSplit picks: "csa_attention" /
// "hca_attention" the default variant (kDependentLaunch), "..._split" kSplitCombine (plain
// launches, the default until 2026-12-04), "..._nopdl" kDependentLaunch with programmatic_launch
// false, "..._noprefetch" kDependentLaunch with prefetch_lookups false; "..._cluster"
// kClusterMerge at the split size SparseDecodeClusterEntriesPerSplit picks (on stderr),
// "..._cluster_nomc" the same with multicast_queries false; "..._qc2" kDependentLaunch with
// query_cluster 2 (pairs of splits share the queries' load; the default is 1, no clusters).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/cuda/bench_util.cuh"
#include "kernels/cuda/indexer.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {
namespace {

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

constexpr int64_t kRate = 4;  // CSA compression
constexpr int64_t kHcaRate = 128;
constexpr int64_t kTopK = 512;
constexpr int64_t kWindow = 128;
constexpr int64_t kPage = 64;
constexpr int64_t kHeads = 64;
constexpr int64_t kMaxBatch = 128;
constexpr int64_t kMaxKeys = 131072 / kRate;
// What the timed rows allocate themselves (attention workspaces and outputs, CUDA graphs) is kept
// free beside the inputs.
constexpr size_t kDeviceReserveBytes = size_t{1} << 30;

// Bytes the indexer reads and writes once at `batch` x `keys` (keys, queries and weights in,
// picks out): its rows' bytes and its read floor's size.
double IndexerBytes(int64_t batch, int64_t keys) {
  return batch * (keys * kIndexHeadDim * 2.0 + kIndexHeads * kIndexHeadDim * 2.0 +
                  kIndexHeads * 4.0 + kTopK * 4.0);
}

// The same for sparse decode attention over `entries` rows per request (rows and queries in,
// output out).
double AttentionBytes(int64_t batch, int64_t entries) {
  return batch * (entries * kSparseHeadDim * 2.0 + 2.0 * kHeads * kSparseHeadDim * 2.0);
}

// One layer's inputs at one context: its own indexer keys and queries (the indexer rows), or its
// own compressed KV, window rows and queries (the attention rows); the phase not running holds
// none.
struct LayerInputs {
  uint16_t* index_pool = nullptr;
  uint16_t* kv_pool = nullptr;
  uint16_t* window_pool = nullptr;
  uint16_t* q_index = nullptr;
  uint16_t* q = nullptr;
};

// Elements of a pool of kMaxBatch requests' `keys` rows of `dim` (request r's page p at
// p * kMaxBatch + r, as the page table addresses them), at least `floor_bytes` (the read floor
// reads its bytes from the pool).
size_t PoolElements(int64_t keys, int64_t dim, double floor_bytes) {
  return std::max(static_cast<size_t>(kMaxBatch * keys * dim),
                  (static_cast<size_t>(floor_bytes) + 15) / 16 * 8);
}

// Whether `bytes` of inputs fit the device's free memory with kDeviceReserveBytes to spare; if
// not, says on stderr which rows are skipped (their cells print "-"), never silently.
bool FitsDeviceMemory(double bytes, const char* rows, int64_t context, size_t layers) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  BENCH_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (bytes + kDeviceReserveBytes <= free_bytes) return true;
  std::fprintf(stderr,
               "skipped: the %s rows at context %lld: %zu layers' inputs take %.2f GB (+ %.2f GB "
               "kept free), %.2f GB of %.2f GB free\n",
               rows, static_cast<long long>(context), layers, bytes / 1e9,
               kDeviceReserveBytes / 1e9, free_bytes / 1e9, total_bytes / 1e9);
  return false;
}

// A buffer of LayerInputs (an alias: nvcc's host pass writes the plain declarator of a member
// pointer with parentheses, which -Wparentheses refuses).
using LayerPool = uint16_t* LayerInputs::*;

// One buffer of each layer's inputs: its member, its elements, its fill's seed (plus 16 x the
// layer: random bf16, the same values at the same offsets at every size).
struct LayerBuffer {
  LayerPool member;
  size_t elements;
  uint32_t seed;
};

// Allocates and fills `buffers` in each layer of `inputs` for the `rows` rows at `context`; false
// (nothing allocated) where they do not fit.
bool AllocInputs(std::vector<LayerInputs>& inputs, const std::vector<LayerBuffer>& buffers,
                 const char* rows, int64_t context) {
  double bytes = 0;
  for (const LayerBuffer& buffer : buffers) bytes += 2.0 * buffer.elements * inputs.size();
  if (!FitsDeviceMemory(bytes, rows, context, inputs.size())) return false;
  for (size_t l = 0; l < inputs.size(); ++l) {
    for (const LayerBuffer& buffer : buffers) {
      uint16_t*& p = inputs[l].*buffer.member;
      p = DeviceAlloc<uint16_t>(buffer.elements);
      FillBf16(p, buffer.elements, 16 * static_cast<uint32_t>(l) + buffer.seed);
    }
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  return true;
}

// Each layer's indexer keys and queries at `context` (AllocInputs).
bool AllocIndexerInputs(std::vector<LayerInputs>& inputs, int64_t context) {
  const int64_t keys = context / kRate;
  return AllocInputs(inputs,
                     {{&LayerInputs::index_pool,
                       PoolElements(keys, kIndexHeadDim, IndexerBytes(kMaxBatch, keys)), 1},
                      {&LayerInputs::q_index, kMaxBatch * kIndexHeads * kIndexHeadDim, 4}},
                     "indexer and top-k", context);
}

// Each layer's compressed KV, window rows and queries at `context` (AllocInputs).
bool AllocAttentionInputs(std::vector<LayerInputs>& inputs, int64_t context) {
  const int64_t keys = context / kRate;
  const int64_t most_entries = kWindow + std::max(kTopK, context / kHcaRate);
  return AllocInputs(
      inputs,
      {{&LayerInputs::kv_pool,
        PoolElements(keys, kSparseHeadDim, AttentionBytes(kMaxBatch, most_entries)), 2},
       {&LayerInputs::window_pool, kMaxBatch * kWindow * kSparseHeadDim, 3},
       {&LayerInputs::q, kMaxBatch * kHeads * kSparseHeadDim, 5}},
      "attention", context);
}

// Frees every layer's inputs (after their rows: kernels done).
void FreeInputs(std::vector<LayerInputs>& inputs) {
  BENCH_CHECK(cudaDeviceSynchronize());
  for (LayerInputs& in : inputs) {
    for (uint16_t* p : {in.index_pool, in.kv_pool, in.window_pool, in.q_index, in.q}) {
      if (p != nullptr) BENCH_CHECK(cudaFree(p));
    }
    in = LayerInputs{};
  }
}

// only_batch / only_context: 0 runs every size, else only that one (for profiling one case, or a
// context between the listed ones).
int Run(int64_t only_batch, int64_t only_context) {
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // kClusterMerge runs in one wave only while its clusters fit: say how many do (stderr).
  int max_active_clusters[kSparseMaxClusterSplits + 1] = {};
  for (int64_t splits = 2; splits <= kSparseMaxClusterSplits; ++splits) {
    max_active_clusters[splits] = SparseDecodeMaxActiveClusters(splits);
    std::fprintf(stderr, "sparse decode clusters of %lld: %d at once (%d multiprocessors)\n",
                 static_cast<long long>(splits), max_active_clusters[splits], sms);
  }
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const char* only = std::getenv("PDSERVE_BENCH_ONLY");
  const bool attention_only = only != nullptr && std::string(only) == "attention";
  const char* timing = std::getenv("PDSERVE_BENCH_TIMING");
  const bool graph = timing != nullptr && std::string(timing) == "graph";
  if (timing != nullptr && !graph && std::string(timing) != "launch") {
    std::fprintf(stderr, "PDSERVE_BENCH_TIMING must be launch or graph, got '%s'\n", timing);
    return 2;
  }
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
      [&] { BENCH_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream)); },
      10, flush, stream);
  std::printf("copy,0,0,0,%.3f,%zu,0\n", copy_us, 2 * copy_bytes);
  BENCH_CHECK(cudaFree(src));
  BENCH_CHECK(cudaFree(dst));

  // Graph timing: 16 layers, each with its own inputs; at 128K they take 16 x 1.07 GB of indexer
  // keys, then 16 x 4.3 GB of compressed KV (one phase at a time: AllocIndexerInputs).
  const int layers = graph ? 16 : 1;
  const std::vector<int64_t> batches = {1, 32, 128};
  // A context outside the list (a multiple of 4 x 64 up to 128K, e.g. 65536) may be asked for as
  // only_context: it is run alone.
  std::vector<int64_t> contexts = {4096, 32768, 131072};
  if (only_context != 0 &&
      std::find(contexts.begin(), contexts.end(), only_context) == contexts.end()) {
    if (only_context < 0 || only_context % (kRate * kPage) != 0 ||
        only_context > kMaxKeys * kRate) {
      std::fprintf(stderr, "context %lld: not a multiple of %lld up to %lld\n",
                   static_cast<long long>(only_context), static_cast<long long>(kRate * kPage),
                   static_cast<long long>(kMaxKeys * kRate));
      return 2;
    }
    contexts = {only_context};
  }
  const int64_t pages_per_request = kMaxKeys / kPage;
  const bool indexer_only = only != nullptr && std::string(only) == "indexer";
  std::vector<LayerInputs> inputs(layers);
  // launch(l) runs layer l's call on `stream`.
  auto time_us = [&](const std::function<void(int)>& launch) {
    return graph ? GraphMicros(launch, layers, 20, stream)
                 : MedianMicros([&] { launch(0); }, 20, flush, stream);
  };
  // The floor for `bytes` (each layer reads its own `pool`, as the kernels do): printed as
  // "<name>_read" with the kernel's row key, so the tables show what a kernel that only read its
  // bytes, contiguously and with nothing else to do, reaches at that size and timing.
  uint4* read_sink = DeviceAlloc<uint4>(1);
  auto print_floor = [&](const char* name, LayerPool pool, int64_t batch, int64_t context,
                         int64_t entries, double bytes) {
    const size_t units = static_cast<size_t>(bytes) / 16;
    const unsigned blocks = static_cast<unsigned>(
        std::min<size_t>(size_t{4} * sms, std::max<size_t>(1, (units + 2047) / 2048)));
    const double us = time_us([&](int l) {
      ReadFloor<<<blocks, 512, 0, stream>>>(reinterpret_cast<const uint4*>(inputs[l].*pool), units,
                                            read_sink);
      BENCH_CHECK(cudaGetLastError());
    });
    std::printf("%s_read,%lld,%lld,%lld,%.3f,%.0f,0\n", name, static_cast<long long>(batch),
                static_cast<long long>(context), static_cast<long long>(entries), us, bytes);
  };
  std::vector<float> host_w(kMaxBatch * kIndexHeads);
  for (size_t i = 0; i < host_w.size(); ++i) host_w[i] = static_cast<float>(i % 13) / 13.0f - 0.4f;
  float* w = DeviceAlloc<float>(host_w.size());
  BENCH_CHECK(cudaMemcpy(w, host_w.data(), host_w.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> host_sinks(kHeads, 0.5f);
  float* sinks = DeviceAlloc<float>(kHeads);
  BENCH_CHECK(cudaMemcpy(sinks, host_sinks.data(), kHeads * 4, cudaMemcpyHostToDevice));
  int32_t* page_table = Upload(Iota(kMaxBatch * pages_per_request, kMaxBatch, pages_per_request));
  float* scores = DeviceAlloc<float>(kMaxBatch * kMaxKeys);
  int32_t* visible = DeviceAlloc<int32_t>(kMaxBatch);
  int32_t* picks = DeviceAlloc<int32_t>(kMaxBatch * kTopK);
  std::vector<int32_t> host_window_page(kMaxBatch);
  for (int64_t b = 0; b < kMaxBatch; ++b) host_window_page[b] = static_cast<int32_t>(b);
  int32_t* window_page = Upload(host_window_page);
  int32_t* window_len = Upload(std::vector<int32_t>(kMaxBatch, kWindow));
  // CSA indices: spread over the visible entries (every (keys / 512)-th), as a top-k would be.
  for (int64_t context : contexts) {
    if (only_context != 0 && context != only_context) continue;
    const int64_t keys = context / kRate;
    int32_t* n_keys = Upload(std::vector<int32_t>(kMaxBatch, static_cast<int32_t>(keys)));
    int32_t* positions = Upload(std::vector<int32_t>(kMaxBatch, static_cast<int32_t>(context - 1)));
    std::vector<int32_t> host_indices(kMaxBatch * kTopK);
    for (size_t i = 0; i < host_indices.size(); ++i) {
      host_indices[i] = static_cast<int32_t>((i % kTopK) * (keys / kTopK) + (i / kTopK) % 3);
    }
    int32_t* indices = Upload(host_indices);
    int32_t* n_hca =
        Upload(std::vector<int32_t>(kMaxBatch, static_cast<int32_t>(context / kHcaRate)));
    // One phase's inputs at a time (indexer, then attention), each sized for this context: the
    // two together at 128K in graph timing (86 GB) do not fit an 80 GB H100.
    if (!attention_only && AllocIndexerInputs(inputs, context)) {
      for (int64_t batch : batches) {
        if (only_batch != 0 && batch != only_batch) continue;
        IndexerParams ip;
        ip.weights = w;
        ip.page_table = page_table;
        ip.page_table_stride = pages_per_request;
        ip.page_size = kPage;
        ip.n_keys = n_keys;
        ip.positions = positions;
        ip.rate = kRate;
        ip.batch = batch;
        ip.max_keys = keys;
        ip.softmax_scale = 0.0883883f;
        // Rows "indexer" / "indexer_scores": the mma.sync scores kernel (the default until
        // 2026-12-04, kept as the baseline); "..._wgmma": the default since
        // (kernels/cuda/indexer.cuh).
        ip.scores_variant = IndexerScoresVariant::kMmaSync;
        auto layer_ip = [&](int l) {
          IndexerParams lp = ip;
          lp.q = reinterpret_cast<const __nv_bfloat16*>(inputs[l].q_index);
          lp.key_pool = reinterpret_cast<const __nv_bfloat16*>(inputs[l].index_pool);
          return lp;
        };
        ip.topk_variant = TopKVariant::kRadixCluster;  // rows indexer, indexer_wgmma: the baselines
        const double us = time_us([&](int l) {
          BENCH_CHECK(lightning_indexer(layer_ip(l), kTopK, scores, visible, picks, stream));
        });
        const double bytes = IndexerBytes(batch, keys);
        const double flops = 2.0 * batch * keys * kIndexHeads * kIndexHeadDim;
        std::printf("indexer,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", static_cast<long long>(batch),
                    static_cast<long long>(context), static_cast<long long>(keys), us, bytes,
                    flops);
        print_floor("indexer", &LayerInputs::index_pool, batch, context, keys, bytes);
        // The two stages alone: scores (keys in, fp32 scores out) and top-k (scores in, picks out).
        const double scores_us = time_us(
            [&](int l) { BENCH_CHECK(indexer_scores(layer_ip(l), scores, visible, stream)); });
        std::printf("indexer_scores,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", static_cast<long long>(batch),
                    static_cast<long long>(context), static_cast<long long>(keys), scores_us,
                    batch * (keys * kIndexHeadDim * 2.0 + keys * 4.0), flops);
        // The warpgroup-MMA scores kernel (IndexerScoresVariant::kWgmma), alone and with top-k:
        // rows "indexer_scores_wgmma" and "indexer_wgmma".
        auto wgmma_ip = [&](int l) {
          IndexerParams lp = layer_ip(l);
          lp.scores_variant = IndexerScoresVariant::kWgmma;
          return lp;
        };
        const double wgmma_scores_us = time_us(
            [&](int l) { BENCH_CHECK(indexer_scores(wgmma_ip(l), scores, visible, stream)); });
        std::printf("indexer_scores_wgmma,%lld,%lld,%lld,%.3f,%.0f,%.0f\n",
                    static_cast<long long>(batch), static_cast<long long>(context),
                    static_cast<long long>(keys), wgmma_scores_us,
                    batch * (keys * kIndexHeadDim * 2.0 + keys * 4.0), flops);
        const double wgmma_us = time_us([&](int l) {
          BENCH_CHECK(lightning_indexer(wgmma_ip(l), kTopK, scores, visible, picks, stream));
        });
        std::printf("indexer_wgmma,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", static_cast<long long>(batch),
                    static_cast<long long>(context), static_cast<long long>(keys), wgmma_us, bytes,
                    flops);
        // Rows "indexer_scores_wgmma_qr": the wgmma scores with the queries in registers
        // (kWgmmaQueryRegisters) alone; "indexer_select": those with the select-sort top-k
        // (TopKVariant::kSelectSort); "indexer_wgmma_select": the kWgmma scores with it.
        auto qr_ip = [&](int l) {
          IndexerParams lp = layer_ip(l);
          lp.scores_variant = IndexerScoresVariant::kWgmmaQueryRegisters;
          lp.topk_variant = TopKVariant::kSelectSort;
          return lp;
        };
        const double qr_scores_us =
            time_us([&](int l) { BENCH_CHECK(indexer_scores(qr_ip(l), scores, visible, stream)); });
        std::printf("indexer_scores_wgmma_qr,%lld,%lld,%lld,%.3f,%.0f,%.0f\n",
                    static_cast<long long>(batch), static_cast<long long>(context),
                    static_cast<long long>(keys), qr_scores_us,
                    batch * (keys * kIndexHeadDim * 2.0 + keys * 4.0), flops);
        // "indexer_wgmma_prefetch": the kWgmma scores with TopKVariant::kSelectPrefetch,
        // "indexer_wgmma_quantile": with kSelectQuantile.
        for (const char* row_name : {"indexer_select", "indexer_wgmma_select",
                                     "indexer_wgmma_prefetch", "indexer_wgmma_quantile"}) {
          const std::string name = row_name;
          const double select_us = time_us([&](int l) {
            IndexerParams lp = qr_ip(l);
            if (name != "indexer_select") lp.scores_variant = IndexerScoresVariant::kWgmma;
            if (name == "indexer_wgmma_prefetch") lp.topk_variant = TopKVariant::kSelectPrefetch;
            if (name == "indexer_wgmma_quantile") lp.topk_variant = TopKVariant::kSelectQuantile;
            BENCH_CHECK(lightning_indexer(lp, kTopK, scores, visible, picks, stream));
          });
          std::printf("%s,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", row_name, static_cast<long long>(batch),
                      static_cast<long long>(context), static_cast<long long>(keys), select_us,
                      bytes, flops);
        }
        const double topk_us = time_us(
            [&](int) { BENCH_CHECK(top_k(scores, batch, keys, visible, kTopK, picks, stream)); });
        std::printf("top_k,%lld,%lld,%lld,%.3f,%.0f,0\n", static_cast<long long>(batch),
                    static_cast<long long>(context), static_cast<long long>(keys), topk_us,
                    batch * (keys * 4.0 + kTopK * 4.0));
        // Rows "top_k_select": TopKVariant::kSelectSort, "top_k_prefetch": kSelectPrefetch,
        // "top_k_quantile": kSelectQuantile, "top_k_quantile_push": kSelectQuantilePush; with
        // PDSERVE_BENCH_TOPK_STAGES=1 also the same launches ended after their stages
        // (top_k_select_stages; rows "top_k_select_s<stage>", "top_k_prefetch_s<stage>").
        const char* topk_stages = std::getenv("PDSERVE_BENCH_TOPK_STAGES");
        const bool stages = topk_stages != nullptr && std::string(topk_stages) == "1";
        for (const TopKVariant variant :
             {TopKVariant::kSelectSort, TopKVariant::kSelectPrefetch, TopKVariant::kSelectQuantile,
              TopKVariant::kSelectQuantilePush}) {
          const std::string name = variant == TopKVariant::kSelectSort       ? "top_k_select"
                                   : variant == TopKVariant::kSelectPrefetch ? "top_k_prefetch"
                                   : variant == TopKVariant::kSelectQuantile
                                       ? "top_k_quantile"
                                       : "top_k_quantile_push";
          for (int stop = 0; stop <= (stages ? 4 : 0); ++stop) {
            const auto launch = [&](int) {
              BENCH_CHECK(top_k_select_stages(scores, batch, keys, visible, kTopK, variant, stop,
                                              picks, stream));
            };
            const double us_s = time_us(launch);
            std::printf("%s%s,%lld,%lld,%lld,%.3f,%.0f,0\n", name.c_str(),
                        stop == 0 ? "" : ("_s" + std::to_string(stop)).c_str(),
                        static_cast<long long>(batch), static_cast<long long>(context),
                        static_cast<long long>(keys), us_s, batch * (keys * 4.0 + kTopK * 4.0));
            if (graph && stop == 0) {  // PDSERVE_BLOCK_TRACE: the whole kernel's timelines
              GraphTrace(name, std::to_string(batch) + "x" + std::to_string(context), keys, launch,
                         layers, stream);
            }
          }
        }
        // PDSERVE_BENCH_TOPK_SWEEP=1: top-k at 1, 2, 4 and 8 blocks per row (rows "top_k_b<blocks
        // per row>" of TopKVariant::kRadixCluster, "top_k_select_b<blocks>" of kSelectSort and
        // "top_k_prefetch_b<blocks>" of kSelectPrefetch and "top_k_quantile_b<blocks>" of
        // kSelectQuantile, which also run 3), to check the ones
        // top_k picks.
        const char* topk_sweep = std::getenv("PDSERVE_BENCH_TOPK_SWEEP");
        const bool sweep_topk = topk_sweep != nullptr && std::string(topk_sweep) == "1";
        for (const TopKVariant variant :
             {TopKVariant::kRadixCluster, TopKVariant::kSelectSort, TopKVariant::kSelectPrefetch,
              TopKVariant::kSelectQuantile}) {
          for (const int64_t blocks : {1, 2, 3, 4, 8}) {
            if (!sweep_topk || (blocks == 3 && variant == TopKVariant::kRadixCluster)) continue;
            const double us_b = time_us([&](int) {
              BENCH_CHECK(top_k_variant(scores, batch, keys, visible, kTopK, variant, blocks, picks,
                                        stream));
            });
            const char* prefix =
                variant == TopKVariant::kSelectSort
                    ? "top_k_select_b"
                    : (variant == TopKVariant::kSelectPrefetch
                           ? "top_k_prefetch_b"
                           : (variant == TopKVariant::kSelectQuantile ? "top_k_quantile_b"
                                                                      : "top_k_b"));
            std::printf("%s%lld,%lld,%lld,%lld,%.3f,%.0f,0\n", prefix,
                        static_cast<long long>(blocks), static_cast<long long>(batch),
                        static_cast<long long>(context), static_cast<long long>(keys), us_b,
                        batch * (keys * 4.0 + kTopK * 4.0));
          }
        }
        // Rows "indexer_wgmma_quantile_capacity" and "top_k_capacity" (contexts below the
        // largest): the scores' row stride the engine passes (engine/gpu/gpu_model.cc
        // FastIndexer: the compressor's capacity; here the largest context's kMaxKeys entries)
        // with this context's lengths, the default kernels. top_k picks its blocks per row from
        // the stride (kernels/cuda/topk.cu PickBlocksPerRow), not from the lengths. Last in the
        // batch's rows: they leave the scores at that stride (the next batch's first rows write
        // them again at `keys`).
        if (keys < kMaxKeys) {
          const double cap_indexer_us = time_us([&](int l) {
            IndexerParams lp = wgmma_ip(l);
            lp.max_keys = kMaxKeys;
            lp.topk_variant = TopKVariant::kSelectQuantile;  // the default, as the row says
            BENCH_CHECK(lightning_indexer(lp, kTopK, scores, visible, picks, stream));
          });
          std::printf("indexer_wgmma_quantile_capacity,%lld,%lld,%lld,%.3f,%.0f,%.0f\n",
                      static_cast<long long>(batch), static_cast<long long>(context),
                      static_cast<long long>(keys), cap_indexer_us, bytes, flops);
          const double cap_topk_us = time_us([&](int) {
            BENCH_CHECK(top_k(scores, batch, kMaxKeys, visible, kTopK, picks, stream));
          });
          std::printf("top_k_capacity,%lld,%lld,%lld,%.3f,%.0f,0\n", static_cast<long long>(batch),
                      static_cast<long long>(context), static_cast<long long>(keys), cap_topk_us,
                      batch * (keys * 4.0 + kTopK * 4.0));
        }
      }
      FreeInputs(inputs);
    }
    // PDSERVE_BENCH_ONLY=indexer: the indexer and top-k rows alone (no attention rows).
    if (indexer_only || !AllocAttentionInputs(inputs, context)) continue;
    for (int64_t batch : batches) {
      if (only_batch != 0 && batch != only_batch) continue;
      for (bool csa : {true, false}) {
        SparseDecodeParams sp;
        sp.batch = batch;
        sp.heads = kHeads;
        sp.window_page = window_page;
        sp.window_len = window_len;
        sp.window_size = kWindow;
        sp.page_table = page_table;
        sp.page_table_stride = pages_per_request;
        sp.page_size = kPage;
        sp.n_compressed = csa ? n_keys : n_hca;
        sp.indices = csa ? indices : nullptr;
        sp.compressed_slots = csa ? kTopK : context / kHcaRate;
        sp.sinks = sinks;
        sp.softmax_scale = 0.0441942f;
        const int64_t entries = kWindow + sp.compressed_slots;
        const char* name = csa ? "csa_attention" : "hca_attention";
        const double attn_bytes = AttentionBytes(batch, entries);
        const double attn_flops = 4.0 * batch * kHeads * entries * kSparseHeadDim;
        // Times the launch at `per` entries per split and prints its row (`suffix` after the name).
        auto time_split = [&](int64_t per, const std::string& suffix,
                              SparseDecodeVariant variant = SparseDecodeVariant::kDependentLaunch,
                              bool programmatic = true, bool prefetch = true, bool multicast = true,
                              int64_t query_cluster = 1) {
          SparseDecodeParams split = sp;
          split.entries_per_split = per;
          split.variant = variant;
          split.programmatic_launch = programmatic;
          split.prefetch_lookups = prefetch;
          split.multicast_queries = multicast;
          split.query_cluster = query_cluster;
          const size_t ws_bytes = SparseDecodeWorkspaceBytes(split);
          void* ws = DeviceAlloc<unsigned char>(ws_bytes);
          __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(
              DeviceAlloc<uint16_t>(batch * kHeads * kSparseHeadDim));
          const auto launch = [&](int l) {
            SparseDecodeParams lp = split;
            lp.q = reinterpret_cast<const __nv_bfloat16*>(inputs[l].q);
            lp.window_pool = reinterpret_cast<const __nv_bfloat16*>(inputs[l].window_pool);
            lp.kv_pool = reinterpret_cast<const __nv_bfloat16*>(inputs[l].kv_pool);
            BENCH_CHECK(sparse_decode_attention(lp, ws, ws_bytes, out, stream));
          };
          const double attn_us = time_us(launch);
          std::printf("%s%s,%lld,%lld,%lld,%.3f,%.0f,%.0f\n", name, suffix.c_str(),
                      static_cast<long long>(batch), static_cast<long long>(context),
                      static_cast<long long>(entries), attn_us, attn_bytes, attn_flops);
          if (graph) {
            GraphTrace(name + suffix, std::to_string(batch) + "x" + std::to_string(context),
                       entries, launch, layers, stream);
          }
          BENCH_CHECK(cudaFree(ws));
          BENCH_CHECK(cudaFree(out));
        };
        time_split(SparseDecodeEntriesPerSplit(batch, kHeads, entries, sms), "");
        constexpr SparseDecodeVariant kOld = SparseDecodeVariant::kSplitCombine;
        time_split(SparseDecodeEntriesPerSplit(batch, kHeads, entries, sms), "_split", kOld);
        // kDependentLaunch launched plainly (no programmatic dependent launch): what PDL adds.
        time_split(SparseDecodeEntriesPerSplit(batch, kHeads, entries, sms), "_nopdl",
                   SparseDecodeVariant::kDependentLaunch, false);
        time_split(SparseDecodeEntriesPerSplit(batch, kHeads, entries, sms), "_noprefetch",
                   SparseDecodeVariant::kDependentLaunch, true, false);
        constexpr SparseDecodeVariant kCluster = SparseDecodeVariant::kClusterMerge;
        const int64_t fit =
            SparseDecodeClusterEntriesPerSplit(batch, kHeads, entries, sms, max_active_clusters);
        std::fprintf(stderr, "%s_cluster,%lld,%lld: %lld entries per split\n", name,
                     static_cast<long long>(batch), static_cast<long long>(context),
                     static_cast<long long>(fit));
        time_split(fit, "_cluster", kCluster);
        time_split(fit, "_cluster_nomc", kCluster, true, true, false);
        // kDependentLaunch in query clusters of 2 (opt-in).
        time_split(SparseDecodeEntriesPerSplit(batch, kHeads, entries, sms), "_qc2",
                   SparseDecodeVariant::kDependentLaunch, true, true, true, 2);
        print_floor(name, &LayerInputs::kv_pool, batch, context, entries, attn_bytes);
        // PDSERVE_BENCH_SPLITS=1: the same launch at every split size, rows
        // "<kernel>@<entries per split>", "<kernel>_split@..." and "<kernel>_cluster@..." (to fit
        // SparseDecodeEntriesPerSplit to measurements).
        const char* sweep = std::getenv("PDSERVE_BENCH_SPLITS");
        if (sweep == nullptr || std::string(sweep) != "1") continue;
        const int64_t whole = (entries + kSparseTile - 1) / kSparseTile * kSparseTile;
        for (int64_t per = kSparseTile; per <= whole; per += kSparseTile) {
          const int64_t splits = (entries + per - 1) / per;
          if (per > kSparseTile && per != whole &&
              (entries + per - kSparseTile - 1) / (per - kSparseTile) == splits) {
            continue;  // only the smallest split size giving each number of splits
          }
          time_split(per, "@" + std::to_string(per));
          time_split(per, "_split@" + std::to_string(per), kOld);
          time_split(per, "_cluster@" + std::to_string(per), kCluster);
        }
      }
    }
    FreeInputs(inputs);
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
