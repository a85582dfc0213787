// Issue 27: the same-host device-to-device path's data movement alone (runtime::DeviceStatePages),
// one process on one GPU, V4-Flash attention shapes (bench/ep/flash_shapes.h, --layers layers,
// CSA and HCA alternating): per prompt length p (--lengths), slot 0 holds a random state at p
// (bench::RandomRingState, imported once); then, median of --repeats:
//   store: slot 0 -> device pages (one allocation, as P's arena) for every layer, with the page
//     checksums on the GPU (store+xxh3) and without (store);
//   load: device pages -> slot 1 (BeginStagedImport, LoadLayer of every layer with the source
//     pages' checksums, FinishStagedImport), as D from a peer's mapped arena;
// checksums over the pages the runs write (those a transfer sends); each timed on the host from
// the first call to the model's stream synchronized (planning,
// descriptor upload and launches included). GB/s = page bytes (every page holding a row of the
// state at p, whole pages: what the transfer sends) / time, beside floor (a): cudaMemcpy device ->
// pinned host -> device of the same bytes (as gpu_state_transfer_bench's). "state MB" is the bytes
// the copies move (rows only). equal: slot 1's exported state equals slot 0's bit for bit after
// the last load. Markdown on stdout, progress on stderr.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/ep/flash_shapes.h"
#include "bench/kvtransfer/copy_floor.h"
#include "common/status.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/random_weights.h"
#include "runtime/cuda/device_state_pages.h"
#include "runtime/paged_state.h"

namespace pdserve::bench {
namespace {

using engine::gpu::DeviceArray;
using engine::gpu::GpuModel;

struct Flags {
  int64_t layers = 8;
  std::string lengths = "4096,32768,131072";
  int64_t repeats = 5;
  int64_t entries_per_page = 64;
};

// One sequence's pages in one device allocation, 256-byte aligned each.
struct Arena {
  DeviceArray<unsigned char> memory;
  runtime::DeviceSequencePages pages;
};

absl::Status MakeArena(const serving::StateLayout& layout, int64_t total, Arena* arena) {
  const serving::PagePoolOptions kinds = layout.PoolOptions(1, total);
  const serving::PageDemand demand = layout.Demand(total);
  auto aligned = [](int64_t n) { return static_cast<size_t>((n + 255) / 256 * 256); };
  size_t bytes = 0;
  for (size_t k = 0; k < demand.size(); ++k) {
    bytes += static_cast<size_t>(demand[k]) * aligned(kinds.kinds[k].page_bytes());
  }
  PDSERVE_RETURN_IF_ERROR(arena->memory.Allocate(bytes));
  PDSERVE_RETURN_IF_ERROR(arena->memory.Fill(0));
  auto* base = reinterpret_cast<std::byte*>(arena->memory.get());
  arena->pages.pages.resize(demand.size());
  size_t at = 0;
  for (size_t k = 0; k < demand.size(); ++k) {
    for (int64_t i = 0; i < demand[k]; ++i) {
      arena->pages.pages[k].push_back(base + at);
      at += aligned(kinds.kinds[k].page_bytes());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ExportedValues(GpuModel& gpu, int64_t slot) {
  PDSERVE_ASSIGN_OR_RETURN(const engine::ModelState state, gpu.ExportState(slot));
  std::vector<float> out;
  for (const engine::LayerState& l : state.layers) {
    out.insert(out.end(), l.window_kv.data.begin(), l.window_kv.data.end());
    for (const engine::CompressorState* c : {&l.compressor, &l.indexer}) {
      for (const engine::Tensor* t :
           {&c->buffer_kv, &c->buffer_gate, &c->overlap_kv, &c->overlap_gate, &c->entries}) {
        out.insert(out.end(), t->data.begin(), t->data.end());
      }
    }
  }
  return out;
}

absl::Status Run(const Flags& flags) {
  std::vector<int64_t> lengths;
  for (absl::string_view p : absl::StrSplit(flags.lengths, ',')) {
    lengths.push_back(std::stoll(std::string(p)));
  }
  engine::ModelConfig config = FlashShapes(flags.layers, 32768);
  config.n_routed_experts = 8;
  config.moe_intermediate_size = 256;
  config.max_position_embeddings = *std::max_element(lengths.begin(), lengths.end()) + 64;
  const engine::Weights weights = engine::FastRandomWeights(config, 1);
  engine::gpu::GpuModelOptions options;
  options.slots = 2;
  options.max_context = config.max_position_embeddings;
  options.max_chunk = 256;
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<GpuModel> gpu,
                           GpuModel::Create(config, weights, options));
  PDSERVE_ASSIGN_OR_RETURN(auto staging, gpu->NewStateStaging(std::min<int64_t>(2, flags.layers)));
  PDSERVE_ASSIGN_OR_RETURN(
      const serving::StateLayout layout,
      runtime::LayoutForModel(config, flags.entries_per_page, serving::ElementType::kBfloat16));
  const auto stream = static_cast<cudaStream_t>(gpu->cuda_stream());
  std::printf(
      "| tokens | page MB | state MB | store+xxh3 ms | GB/s | store ms | GB/s | load+xxh3 ms | "
      "GB/s | floor (a) GB/s | store+xxh3 / floor | load+xxh3 / floor | equal |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int64_t length : lengths) {
    std::fprintf(stderr, "length %ld: state\n", static_cast<long>(length));
    PDSERVE_RETURN_IF_ERROR(
        gpu->ImportState(0, RandomRingState(config, options.max_context, length), staging.get()));
    const int64_t total = length + 1;
    PDSERVE_ASSIGN_OR_RETURN(auto device,
                             runtime::DeviceStatePages::Create(gpu.get(), layout, total));
    Arena arena;
    PDSERVE_RETURN_IF_ERROR(MakeArena(layout, total, &arena));
    // The pages sent: every page a run writes (whole pages: their bytes are the GB/s' bytes), each
    // checksummed, as the transfer plan's pages of the prompt.
    size_t page_bytes = 0;
    size_t checksum_count = 0;
    std::vector<size_t> first_checksum;
    std::vector<std::vector<runtime::PagedState::PageId>> checksum_pages;
    const engine::RingGeometry geometry = engine::RingGeometryFor(config, options.max_context, 64);
    for (int64_t l = 0; l < flags.layers; ++l) {
      PDSERVE_ASSIGN_OR_RETURN(
          const auto runs,
          device->paged().PlanPageRuns(l, geometry.layers[static_cast<size_t>(l)], length));
      std::set<std::pair<int, int64_t>> touched;
      for (const auto& run : runs) touched.insert({static_cast<int>(run.kind), run.page});
      first_checksum.push_back(checksum_count);
      checksum_pages.emplace_back();
      for (const auto& [kind, page] : touched) {
        const auto state_kind = static_cast<serving::StateKind>(kind);
        page_bytes += static_cast<size_t>(layout.Kind(state_kind).page_bytes());
        checksum_pages.back().push_back({state_kind, page});
      }
      checksum_count += checksum_pages.back().size();
    }
    DeviceArray<uint64_t> checksums;
    PDSERVE_RETURN_IF_ERROR(checksums.Allocate(checksum_count));
    std::vector<double> store_hash_ms, store_ms, load_ms;
    int64_t state_bytes = 0;
    for (int64_t r = 0; r <= flags.repeats; ++r) {  // repeat 0 warms up
      for (bool hash : {true, false}) {
        PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
        const Clock::time_point start = Clock::now();
        state_bytes = 0;
        for (int64_t l = 0; l < flags.layers; ++l) {
          PDSERVE_RETURN_IF_ERROR(device->StoreLayer(
              0, l, length, arena.pages,
              hash ? runtime::DevicePageChecksums{checksum_pages[static_cast<size_t>(l)],
                                                  checksums.get() +
                                                      first_checksum[static_cast<size_t>(l)]}
                   : runtime::DevicePageChecksums{}));
          state_bytes += device->last_copied_bytes();
        }
        PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
        if (r > 0) (hash ? store_hash_ms : store_ms).push_back(Seconds(start) * 1e3);
      }
      std::fprintf(stderr, "length %ld repeat %ld: load\n", static_cast<long>(length),
                   static_cast<long>(r));
      PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
      const Clock::time_point start = Clock::now();
      PDSERVE_RETURN_IF_ERROR(gpu->BeginStagedImport(1, length));
      for (int64_t l = 0; l < flags.layers; ++l) {
        PDSERVE_RETURN_IF_ERROR(
            device->LoadLayer(1, l, arena.pages,
                              {checksum_pages[static_cast<size_t>(l)],
                               checksums.get() + first_checksum[static_cast<size_t>(l)]}));
      }
      PDSERVE_RETURN_IF_ERROR(gpu->FinishStagedImport(1));
      PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
      if (r > 0) load_ms.push_back(Seconds(start) * 1e3);
    }
    PDSERVE_ASSIGN_OR_RETURN(const std::vector<float> want, ExportedValues(*gpu, 0));
    PDSERVE_ASSIGN_OR_RETURN(const std::vector<float> got, ExportedValues(*gpu, 1));
    const bool equal = want.size() == got.size() &&
                       std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0;
    PDSERVE_ASSIGN_OR_RETURN(const double floor, CopyFloor(page_bytes));
    auto gbps = [&](double ms) { return static_cast<double>(page_bytes) / (ms / 1e3) / 1e9; };
    const double sh = Median(store_hash_ms);
    const double s = Median(store_ms);
    const double ld = Median(load_ms);
    std::printf(
        "%s", absl::StrFormat("| %d | %.1f | %.1f | %.3f | %.1f | %.3f | %.1f | %.3f | %.1f "
                              "| %.1f | %.0f%% | %.0f%% | %s |\n",
                              length, page_bytes / 1e6, state_bytes / 1e6, sh, gbps(sh), s, gbps(s),
                              ld, gbps(ld), floor, 100 * gbps(sh) / floor, 100 * gbps(ld) / floor,
                              equal ? "yes" : "NO")
                  .c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app{"Device pages <-> GPU slot (issue 27's device-to-device data movement)"};
  app.add_option("--layers", flags.layers, "V4-Flash attention layers");
  app.add_option("--lengths", flags.lengths, "prompt lengths, comma-separated");
  app.add_option("--repeats", flags.repeats, "timed repeats (median)");
  app.add_option("--entries-per-page", flags.entries_per_page, "entries per state page");
  CLI11_PARSE(app, argc, argv);
  const absl::Status status = pdserve::bench::Run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "device_pages_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
