// Issue 27, the decode side's host work of importing a transferred prompt state, without a GPU:
// from bf16 state pages (a CUDA prefill's, V4-Flash attention shapes) to the device's layer
// blocks in host memory, as a staging buffer would hold them before the host-to-device copies.
//   old: PagedState::Load into a CPU-layout state (fp32), then per layer the ring image of that
//        state (engine::LayerRingImage) rounded back to bf16 (what ImportState(staging) did);
//   new: PagedState::LoadLayerRing straight from the pages (what GpuModel::ImportLayers' fill
//        does in the decode runner), after the NaN fill ImportLayers writes.
// Both write one reused layer buffer per path; the two buffers are compared bit for bit per
// layer ("equal"). Milliseconds are medians of --repeats on one host thread. The GPU copies,
// which overlap the fill of the next layer, are not part of this (gpu_state_transfer_bench).
// Also the prefill side's host work on the same state (StoreLayerRing of every layer into the
// bf16 pages), which gpu_state_transfer_bench's "transfer ms" includes, and the sender's xxh3
// pass over those pages. With --threads N > 1 the store, the new import and the checksums also
// run spread over a TaskPool of N threads (what the CUDA prefill engine, the decode runner and
// the sender's checksum_pool do), checked byte for byte against the one-thread result.
// Markdown on stdout.
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_split.h"
#include "bench/ep/flash_shapes.h"
#include "common/task_pool.h"
#include "engine/ring_state.h"
#include "kvtransfer/page_header.h"
#include "runtime/paged_state.h"
#include "serving/element_type.h"
#include "serving/page_pool.h"

namespace pdserve::bench {
namespace {

// One layer's blocks in host memory (the staging buffer's role).
struct LayerBuffer {
  std::vector<uint16_t> window, entries, keys;
  std::vector<float> kv, gate, index_kv, index_gate;

  explicit LayerBuffer(const engine::RingLayerGeometry& g) {
    window.resize(static_cast<size_t>(g.window * g.head_dim));
    for (auto [c, kv_, gate_, e] : {std::tuple{&g.compressor, &kv, &gate, &entries},
                                    std::tuple{&g.indexer, &index_kv, &index_gate, &keys}}) {
      if (!c->present()) continue;
      kv_->resize(static_cast<size_t>(2 * c->rate * c->width()));
      gate_->resize(kv_->size());
      e->resize(static_cast<size_t>(c->entry_capacity * c->dim));
    }
  }
  engine::MutableRingLayerBlocks Blocks() {
    return {window.data(),
            {kv.data(), gate.data(), entries.data()},
            {index_kv.data(), index_gate.data(), keys.data()}};
  }
  // The fresh pool's NaN on every row, as ImportLayers writes before the fill.
  void FillUnread() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const uint16_t nan_bf16 = serving::FloatToBf16(nan);
    std::fill(window.begin(), window.end(), nan_bf16);
    for (auto* v : {&kv, &gate, &index_kv, &index_gate}) std::fill(v->begin(), v->end(), nan);
  }
  // Bits compared on the entry rows both paths write (the rest is NaN on the device).
  bool Same(const LayerBuffer& o, size_t entry_values, size_t key_values) const {
    auto eq = [](const auto& a, const auto& b, size_t n) {
      return std::memcmp(a.data(), b.data(), n * sizeof(a[0])) == 0;
    };
    return eq(window, o.window, window.size()) && eq(kv, o.kv, kv.size()) &&
           eq(gate, o.gate, gate.size()) && eq(index_kv, o.index_kv, index_kv.size()) &&
           eq(index_gate, o.index_gate, index_gate.size()) &&
           eq(entries, o.entries, entry_values) && eq(keys, o.keys, key_values);
  }
};

void RoundInto(const std::vector<float>& from, size_t n, uint16_t* to) {
  for (size_t i = 0; i < n; ++i) to[i] = serving::FloatToBf16(from[i]);
}

// Every page's bytes, in kind order (for comparing two stores).
std::vector<std::byte> Snapshot(const runtime::SequencePages& pages) {
  std::vector<std::byte> out;
  for (const auto& kind : pages.pages) {
    for (const auto& page : kind) out.insert(out.end(), page.begin(), page.end());
  }
  return out;
}

// xxh3-64 of every page (the sender's pass), on `pool` or this thread.
std::vector<uint64_t> Checksums(const runtime::SequencePages& pages, TaskPool* pool) {
  std::vector<std::span<const std::byte>> all;
  for (const auto& kind : pages.pages) all.insert(all.end(), kind.begin(), kind.end());
  std::vector<uint64_t> sums(all.size());
  auto one = [&](int64_t i) {
    sums[static_cast<size_t>(i)] = kv::PayloadChecksum(all[static_cast<size_t>(i)]);
  };
  if (pool == nullptr) {
    for (size_t i = 0; i < all.size(); ++i) one(static_cast<int64_t>(i));
  } else {
    pool->Run(static_cast<int64_t>(all.size()), one);
  }
  return sums;
}

int Run(int64_t layers, const std::string& lengths_flag, int repeats, int threads) {
  TaskPool task_pool(threads);
  std::vector<int64_t> lengths;
  for (absl::string_view p : absl::StrSplit(lengths_flag, ',')) {
    lengths.push_back(std::stoll(std::string(p)));
  }
  engine::ModelConfig config = FlashShapes(layers, 32768);
  const int64_t max_context = *std::max_element(lengths.begin(), lengths.end()) + 64;
  config.max_position_embeddings = max_context;
  const engine::RingGeometry geometry = engine::RingGeometryFor(config, max_context, 64);
  const serving::StateLayout layout =
      *runtime::LayoutForModel(config, 64, serving::ElementType::kBfloat16);
  std::printf(
      "| prompt tokens | layers | page bytes (bf16) | old: Load + ring image ms | new: "
      "LoadLayerRing ms | old / new | equal | prefill: StoreLayerRing ms | threads | "
      "StoreLayerRing ms, threads | LoadLayerRing ms, threads | xxh3 ms | xxh3 ms, threads | "
      "threads == 1 thread |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (int64_t length : lengths) {
    const int64_t total = length + 1;
    const engine::ModelState state = RandomRingState(config, max_context, length);
    auto pool = *serving::PagePool::Create(layout.PoolOptions(1, total));
    const serving::PageTable table = *pool->Allocate(1, layout.Demand(total));
    const runtime::SequencePages pages = *runtime::MapPages(*pool, table);
    size_t page_bytes = 0;
    for (const auto& kind : pages.pages) {
      for (const auto& page : kind) page_bytes += page.size();
    }
    const runtime::PagedState paged(config, layout, total);
    if (!paged.Store(state, 0, pages).ok()) return 1;
    std::vector<LayerBuffer> old_buffers, new_buffers;
    for (const engine::RingLayerGeometry& g : geometry.layers) {
      old_buffers.emplace_back(g);
      new_buffers.emplace_back(g);
    }
    // The prefill side's host work on the same state, for comparison with the transfer times:
    // StoreLayerRing of every layer from the device's blocks (bf16 bits) into the bf16 pages.
    const engine::RingImage device =
        *engine::RingImageFromState(geometry, state, std::numeric_limits<float>::quiet_NaN());
    std::vector<std::vector<uint16_t>> bits;
    std::vector<engine::RingLayerBlocks> device_blocks;
    for (const engine::RingLayerImage& li : device.layers) {
      for (const std::vector<float>* v :
           {&li.window, &li.compressor.entries, &li.indexer.entries}) {
        std::vector<uint16_t>& b = bits.emplace_back(v->size());
        RoundInto(*v, v->size(), b.data());
      }
      const size_t at = bits.size() - 3;
      device_blocks.push_back(
          {bits[at].data(),
           {li.compressor.ring_kv.data(), li.compressor.ring_gate.data(), bits[at + 1].data()},
           {li.indexer.ring_kv.data(), li.indexer.ring_gate.data(), bits[at + 2].data()}});
    }
    std::vector<double> old_ms, new_ms, store_ms, pool_store_ms, pool_load_ms, sum_ms, pool_sum_ms;
    bool equal = true;
    bool same_threaded = true;
    std::vector<LayerBuffer> pool_buffers;
    for (const engine::RingLayerGeometry& g : geometry.layers) pool_buffers.emplace_back(g);
    // Both stores start from the same scribbled pages: the rows a store does not write (unused
    // row tails) then compare equal too.
    auto scribble = [&pages] {
      for (const auto& kind : pages.pages) {
        for (const auto& page : kind) std::memset(page.data(), 0xA5, page.size());
      }
    };
    for (int r = 0; r < repeats; ++r) {
      scribble();
      Clock::time_point stored = Clock::now();
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        if (!paged
                 .StoreLayerRing(static_cast<int64_t>(l), geometry.layers[l], device_blocks[l],
                                 length, pages)
                 .ok()) {
          return 1;
        }
      }
      store_ms.push_back(Seconds(stored) * 1e3);
      const std::vector<std::byte> one_thread = Snapshot(pages);
      Clock::time_point summed = Clock::now();
      const std::vector<uint64_t> sums = Checksums(pages, nullptr);
      sum_ms.push_back(Seconds(summed) * 1e3);
      summed = Clock::now();
      same_threaded = same_threaded && Checksums(pages, &task_pool) == sums;
      pool_sum_ms.push_back(Seconds(summed) * 1e3);
      // The same store on the pool.
      scribble();
      stored = Clock::now();
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        if (!paged
                 .StoreLayerRing(static_cast<int64_t>(l), geometry.layers[l], device_blocks[l],
                                 length, pages, &task_pool)
                 .ok()) {
          return 1;
        }
      }
      pool_store_ms.push_back(Seconds(stored) * 1e3);
      same_threaded = same_threaded && Snapshot(pages) == one_thread;
      Clock::time_point start = Clock::now();
      engine::ModelState loaded =
          *engine::StateFromRingImage(geometry, engine::NewRingImage(geometry));
      if (!paged.Load(length, pages, &loaded).ok()) return 1;
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        const engine::RingLayerImage image =
            engine::LayerRingImage(geometry.layers[l], loaded.layers[l], length,
                                   std::numeric_limits<float>::quiet_NaN(), /*entries=*/false);
        LayerBuffer& b = old_buffers[l];
        RoundInto(image.window, image.window.size(), b.window.data());
        for (auto [ci, cs, kv, gate, e] :
             {std::tuple{&image.compressor, &loaded.layers[l].compressor, &b.kv, &b.gate,
                         &b.entries},
              std::tuple{&image.indexer, &loaded.layers[l].indexer, &b.index_kv, &b.index_gate,
                         &b.keys}}) {
          if (ci->ring_kv.empty()) continue;
          std::memcpy(kv->data(), ci->ring_kv.data(), ci->ring_kv.size() * sizeof(float));
          std::memcpy(gate->data(), ci->ring_gate.data(), ci->ring_gate.size() * sizeof(float));
          RoundInto(cs->entries.data, cs->entries.data.size(), e->data());
        }
      }
      old_ms.push_back(Seconds(start) * 1e3);
      start = Clock::now();
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        new_buffers[l].FillUnread();
        if (!paged
                 .LoadLayerRing(static_cast<int64_t>(l), geometry.layers[l], length, pages,
                                new_buffers[l].Blocks())
                 .ok()) {
          return 1;
        }
      }
      new_ms.push_back(Seconds(start) * 1e3);
      start = Clock::now();
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        pool_buffers[l].FillUnread();
        if (!paged
                 .LoadLayerRing(static_cast<int64_t>(l), geometry.layers[l], length, pages,
                                pool_buffers[l].Blocks(), &task_pool)
                 .ok()) {
          return 1;
        }
      }
      pool_load_ms.push_back(Seconds(start) * 1e3);
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        const engine::RingLayerGeometry& g = geometry.layers[l];
        const size_t entries = g.compressor.present()
                                   ? static_cast<size_t>(length / g.compressor.rate * g.head_dim)
                                   : 0;
        const size_t keys =
            g.indexer.present() ? static_cast<size_t>(length / g.indexer.rate * g.indexer.dim) : 0;
        equal = equal && new_buffers[l].Same(old_buffers[l], entries, keys);
        same_threaded = same_threaded && pool_buffers[l].Same(new_buffers[l], entries, keys);
      }
    }
    const double o = Median(old_ms);
    const double n = Median(new_ms);
    std::printf(
        "| %lld | %lld | %.1f MB | %.1f | %.1f | %.1fx | %s | %.1f | %d | %.1f | %.1f | %.1f | "
        "%.1f | %s |\n",
        static_cast<long long>(length), static_cast<long long>(layers),
        static_cast<double>(page_bytes) / 1e6, o, n, o / n, equal ? "equal" : "DIFFERS",
        Median(store_ms), task_pool.threads(), Median(pool_store_ms), Median(pool_load_ms),
        Median(sum_ms), Median(pool_sum_ms), same_threaded ? "equal" : "DIFFERS");
    std::fflush(stdout);
    if (!equal || !same_threaded) return 2;
  }
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  int64_t layers = 8;
  std::string lengths = "4096,32768,131072";
  int repeats = 3;
  int threads = 0;
  CLI::App app("Host work of importing a transferred state: Load + ring image vs LoadLayerRing");
  app.add_option("--layers", layers, "V4-Flash-shaped layers (CSA / HCA alternating)");
  app.add_option("--lengths", lengths, "Prompt lengths, comma-separated");
  app.add_option("--repeats", repeats, "Repeats per length (median)");
  app.add_option("--threads", threads,
                 "Threads of the pooled columns (0: DefaultTransferHostThreads of this host)");
  CLI11_PARSE(app, argc, argv);
  if (threads <= 0) {
    threads = pdserve::DefaultTransferHostThreads(std::thread::hardware_concurrency());
  }
  return pdserve::bench::Run(layers, lengths, repeats, threads);
}
