// Issue 27's GPU -> GPU state transfer benchmark: a CUDA prefill's state to a CUDA decode slot
// through the product path, between two processes on one GPU (the decode process is the parent,
// the prefill process a child forked before CUDA and UCX start), over UCX (transport from
// UCX_TLS), at DeepSeek-V4-Flash attention shapes (bench/ep/flash_shapes.h: head_dim 512, indexer
// 64 x 128, window 128, CSA rate 4 / HCA rate 128 alternating; small MoE, random weights).
//
// Per prompt length p (--lengths) and repeat: the prefill process restores its slot's state
// before the prompt's last chunk (made once per length: a real GpuModel::Forward over
// --chunk-token chunks when p <= --forward-max, else a random state: a forward of that length
// at these shapes takes much longer than the transfer), prepares the transfer, and runs the last
// chunk for real as GpuPrefillEngine::Run does on one GPU (--overlap, the default:
// GpuModel::BeginForwardExporting, each layer's state copied to the pinned staging as soon as the
// chunk's attention has written it, and runtime::StoreSlotStaged storing and posting each layer
// on this thread while the later layers compute, then FinishForward; --overlap 0: a plain
// Forward, then StoreSlotStaged). The stores run on a TaskPool of --host-threads, and the
// sender takes each posted layer's checksums on the same pool; then the commit. t0 = the end of
// the chunk's compute (CUDA events around it on the model's stream). The decode process (bf16
// pool, TransferReceiver) verifies (t_verified); with --early-import (the default) it claimed its
// slot when it issued the ticket and imported each layer as the receiver reported its pages
// landed and checked (runtime::EarlyImporter over runtime::GpuSlotImporter: the fill by
// PagedState::LoadLayerRing on its own pool of --host-threads, the copies on the model's import
// stream), so after t_verified it only waits for the last layers' copies and finishes the slot
// (t_imported); with --early-import 0 it does then what the direct import does:
// GpuModel::ImportLayers filled by PagedState::LoadLayerRing, straight from the pages into its
// slot (t_imported). Then, with --old-import, the previous path
// (PagedState::Load into a CPU-layout state + ImportState through the same staging: "old import
// ms"), which must leave the same slot. Both clocks are CLOCK_MONOTONIC of one machine.
//
// Columns: lanes (UCX workers and threads on each side; --lanes, default what the workers use),
// host threads, bytes on the wire (bf16 pages as sent); where the time after t0 went: copy wait
// (waiting for device -> pinned copies), store (pinned blocks -> pages), post (the layer
// callbacks: the checksums on the pool and the first sends), send drain (all layers posted ->
// commit delivered), verify lag (commit delivered -> the receiver's verified outcome); with
// --overlap the first three run (partly) before t0. Transfer ms = t_verified - t0 and its GB/s
// (1e9 B/s), import ms, end-to-end GB/s = bytes / (t_imported - t0) (with --overlap not a
// bandwidth of the path: part of it moved before t0); the floor of the same path's copies:
// cudaMemcpy device -> pinned host -> device of the same bytes in one process (GB/s = bytes / (D2H
// + H2D time)) and our end-to-end share of it; the forward's ms (the whole prompt, measured once
// per length up to
// --forward-max; past it extrapolated linearly from the longest measured one, "est."); the time
// left after the last layer's compute (t_imported - t0) as a share of TTFT (forward + that);
// "state": whether the decode slot's exported state equals the prefill slot's bit for bit (xxh3
// of every tensor); overlap; the last chunk's compute ms; the chunks' logits rows brought to the
// host (--chunk-logits: all, or the last only); finish forward ms (FinishForward's host time
// with --overlap: the wait for the chunk's end and the copy of its logits into a host tensor);
// early import (yes: import ms is then only what was left of the import after t_verified); shm
// pull (yes with --shm-pull: the decode process copied the pages out of the prefill process's
// pool). Per length, --warmup transfers first (not in the medians: the first one pays the
// length's first-use costs), then --repeats measured ones: medians, and the last columns the
// end-to-end (t_imported - t0) median and min, the best GB/s, the first transfer's end-to-end
// ("first use ms") and the counts. Markdown on stdout, progress on stderr. ucx_perftest over the
// same transport is run by the scripts next to this (tools/gpu/run_transfer_host_threads.sh).
#include <cuda_runtime.h>
#include <poll.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/ep/flash_shapes.h"
#include "bench/kvtransfer/copy_floor.h"
#include "common/clock.h"
#include "common/status.h"
#include "common/task_pool.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/random_weights.h"
#include "engine/ring_state.h"
#include "kvtransfer/cuda_ipc/cuda_page_lander.h"
#include "kvtransfer/cuda_ipc/ipc_page_arena.h"
#include "kvtransfer/transfer_plan.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucx_lane.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "runtime/cuda/device_state_pages.h"
#include "runtime/cuda/gpu_prefill_engine.h"
#include "runtime/cuda/gpu_slot_importer.h"
#include "runtime/early_import.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"
#include "worker/worker_model.h"
#include "xxhash.h"

namespace pdserve::bench {
namespace {

using engine::gpu::CudaStatus;
using engine::gpu::GpuModel;

struct Flags {
  int64_t layers = 8;
  std::string lengths = "4096,32768,131072";
  int64_t forward_max = 32768;
  int64_t chunk = 256;  // the CUDA backend's max_chunk
  // 1: the prompt's prefix state kept in slot 1 on the device and restored by CopySlot each
  // repeat; 0: kept on the host (ExportState / ImportState, slow at 43 layers and 128K).
  int prefix_slot = 1;
  // Per length: `warmup` transfers first (the first one pays each length's first-use costs: its
  // end-to-end time is the "first use ms" column), then `repeats` measured ones (medians, and the
  // best end-to-end).
  int64_t warmup = 1;
  int64_t repeats = 5;
  int lanes = 0;           // UCX lanes on each side; 0: kv::DefaultTransferLanes, what workers use
  int host_threads = 0;    // store / checksum / import threads; 0: DefaultTransferHostThreads
  int64_t window_mib = 0;  // the sender's max_in_flight_bytes; 0: kv::InFlightBytesForLanes
  bool old_import = true;  // also time the previous import path
  // The decode slot is claimed at the ticket and each layer imported as its pages arrive
  // (runtime::EarlyImporter over GpuSlotImporter); false: the direct import after verification.
  bool early_import = true;
  bool overlap = true;        // the last chunk begun, the stores during it (GpuPrefillEngine's way)
  bool post_on_lanes = true;  // the page sends posted by the lane threads (UcxTransport's default)
  // The decode process pulls the pages out of the prefill process's pool (transfer.shm_pull:
  // kvtransfer/shm/pull.h); UCX carries only the page references, commit and heartbeats.
  bool shm_pull = false;
  // The same-host device-to-device path (docs/protocol.md, "Same-host device-to-device pages
  // (CUDA IPC)"): pages in the prefill process's GPU arena, landed in the decode process's GPU
  // pages by its lanes' CudaPageLanders, imported device to device (PrefillIpc / DecodeIpc).
  bool cuda_ipc = false;
  // With --cuda-ipc: the page-reference version the prefill writes (3: compact batches, 2: one
  // 192-byte reference a page; SenderOptions::device_ref_version) and how the decode's landers
  // move their descriptors and hashes (cuda_ipc::LanderMode: "staged", "mapped" or "fused").
  int refs = 3;
  std::string lander = "fused";
  // With --cuda-ipc: every layer's pages stored in one DeviceStatePages::StoreLayers (one upload
  // and two launches) instead of StoreLayer per layer.
  bool store_all = true;
  // With --cuda-ipc: the decode's import in DeviceStatePages::ImportSlotBatched (every layer's
  // fills in one launch and copies in one more) instead of ImportSlot.
  bool import_all = true;
  // With --cuda-ipc: the transfer prepared before the chunk runs and its checksums given after
  // the store (DevicePages::checksums_pending, Transfer::SetDeviceChecksums: the prefill
  // worker's order); 0: prepared with the checksums after the store.
  bool prepare_early = true;
  // The prompt chunks' logits rows brought to the host (GpuModel's ChunkLogits): "all" or
  // "last"; empty: engine::gpu::ServingChunkLogits(), what the serving paths use.
  std::string chunk_logits;
};

engine::gpu::ChunkLogits ChunkRows(const Flags& flags) {
  if (flags.chunk_logits.empty()) return engine::gpu::ServingChunkLogits();
  return flags.chunk_logits == "last" ? engine::gpu::ChunkLogits::kLastRow
                                      : engine::gpu::ChunkLogits::kAllRows;
}

int HostThreads(const Flags& flags) {
  return flags.host_threads > 0 ? flags.host_threads
                                : DefaultTransferHostThreads(std::thread::hardware_concurrency());
}

int Lanes(const Flags& flags) {
  return flags.lanes > 0 ? flags.lanes
                         : kv::DefaultTransferLanes(std::thread::hardware_concurrency());
}

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000ll + ts.tv_nsec;
}

// A timestamped progress line on stderr (seconds since the process started).
void Progress(const char* role, int64_t length, int64_t repeat, const char* what) {
  static const int64_t start = NowNs();
  std::fprintf(stderr, "%8.3f s %s %lld tokens, repeat %lld: %s\n",
               static_cast<double>(NowNs() - start) / 1e9, role, static_cast<long long>(length),
               static_cast<long long>(repeat), what);
}

[[noreturn]] void Die(const char* role, const absl::Status& status) {
  std::fprintf(stderr, "gpu_state_transfer_bench %s: %s\n", role, status.ToString().c_str());
  std::exit(1);
}

// A line-oriented pipe between the two processes.
class Channel {
 public:
  Channel(int read_fd, int write_fd) : read_fd_(read_fd), write_fd_(write_fd) {}
  void Write(const std::string& line) {
    const std::string data = line + "\n";
    if (write(write_fd_, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
      Die("channel", absl::UnavailableError("pipe write"));
    }
  }
  std::string Read() {
    std::string line;
    char c;
    while (read(read_fd_, &c, 1) == 1 && c != '\n') line += c;
    return line;
  }

 private:
  int read_fd_;
  int write_fd_;
};

std::string Hex(std::span<const std::byte> bytes) {
  std::string out;
  for (std::byte b : bytes) {
    out += absl::StrCat(absl::Hex(static_cast<unsigned>(b), absl::kZeroPad2));
  }
  return out;
}

std::vector<std::byte> Unhex(const std::string& hex) {
  std::vector<std::byte> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::vector<int64_t> Lengths(const Flags& flags) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(flags.lengths, ','))
    out.push_back(std::stoll(std::string(p)));
  return out;
}

engine::ModelConfig Config(const Flags& flags) {
  engine::ModelConfig config = FlashShapes(flags.layers, 32768);
  config.n_routed_experts = 8;
  config.moe_intermediate_size = 256;
  const std::vector<int64_t> lengths = Lengths(flags);
  config.max_position_embeddings = *std::max_element(lengths.begin(), lengths.end()) + 64;
  return config;
}

absl::StatusOr<std::unique_ptr<GpuModel>> MakeModel(const Flags& flags,
                                                    const engine::ModelConfig& config) {
  const engine::Weights weights = engine::FastRandomWeights(config, 1);
  engine::gpu::GpuModelOptions options;
  options.slots = flags.prefix_slot != 0 ? 2 : 1;
  options.max_context = config.max_position_embeddings;
  options.max_chunk = flags.chunk;
  return GpuModel::Create(config, weights, options);
}

// One process's model (slot 0), its bf16 page layout and layer attentions.
struct Side {
  engine::ModelConfig config;
  std::unique_ptr<GpuModel> gpu;
  serving::StateLayout layout;
  std::vector<kv::LayerAttention> layers;
};
absl::StatusOr<Side> MakeSide(const Flags& flags, const char* role) {
  engine::ModelConfig config = Config(flags);
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<GpuModel> gpu, MakeModel(flags, config));
  Progress(role, 0, 0, "model made");
  PDSERVE_ASSIGN_OR_RETURN(
      serving::StateLayout layout,
      runtime::LayoutForModel(config, 64, runtime::StorageElement(/*cuda=*/true)));
  std::vector<kv::LayerAttention> layers = worker::LayerAttentions(config);
  return Side{std::move(config), std::move(gpu), std::move(layout), std::move(layers)};
}

// xxh3-64 over every tensor of slot 0's exported state, in order.
absl::StatusOr<uint64_t> StateDigest(GpuModel& gpu) {
  PDSERVE_ASSIGN_OR_RETURN(const engine::ModelState state, gpu.ExportState(0));
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  auto add = [&](const engine::Tensor& t) {
    XXH3_64bits_update(h, t.data.data(), t.data.size() * sizeof(float));
  };
  for (const engine::LayerState& l : state.layers) {
    add(l.window_kv);
    for (const engine::CompressorState* c : {&l.compressor, &l.indexer}) {
      for (const engine::Tensor* t :
           {&c->buffer_kv, &c->buffer_gate, &c->overlap_kv, &c->overlap_gate, &c->entries}) {
        add(*t);
      }
    }
  }
  const uint64_t digest = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return digest;
}

struct Pages {
  std::unique_ptr<kv::shm::SharedRegion> region;  // With --shm-pull: the pool's memory.
  std::unique_ptr<serving::PagePool> pool;
  serving::PageTable table;
  runtime::SequencePages pages;
  std::vector<kv::PlannedPage> plan;
};

absl::StatusOr<Pages> MakePages(const serving::StateLayout& layout,
                                std::span<const kv::LayerAttention> layers, int64_t prompt,
                                int64_t total, bool shared = false) {
  Pages p;
  serving::PagePoolOptions options = layout.PoolOptions(1, total);
  if (shared) {
    PDSERVE_ASSIGN_OR_RETURN(
        p.region, kv::shm::SharedRegion::Create(kv::shm::kPagesPurpose,
                                                serving::PagePool::HostBytesNeeded(options)));
    options.host_block = p.region->bytes();
  }
  PDSERVE_ASSIGN_OR_RETURN(p.pool, serving::PagePool::Create(std::move(options)));
  PDSERVE_ASSIGN_OR_RETURN(p.table, p.pool->Allocate(1, layout.Demand(total)));
  PDSERVE_ASSIGN_OR_RETURN(p.pages, runtime::MapPages(*p.pool, p.table));
  PDSERVE_ASSIGN_OR_RETURN(p.plan, kv::PlanTransfer(layout, layers, p.table, prompt, total));
  return p;
}

// The benchmark's prompt ids at positions [from, to).
std::vector<int32_t> ChunkTokens(const engine::ModelConfig& config, int64_t from, int64_t to) {
  std::vector<int32_t> tokens;
  for (int64_t i = from; i < to; ++i) {
    tokens.push_back(static_cast<int32_t>((31 * i + 5) % config.vocab_size));
  }
  return tokens;
}

// The prompt's state before its last chunk, in slot 0: made once per length (repeat 0: a real
// forward up to --forward-max, timed into `forward_ms`, else a random state) and kept in slot 1
// (--prefix-slot 1, CopySlot) or on the host in `prefix_state` (0); every later repeat restores
// it. The last chunk then runs for real.
absl::Status RestorePrefix(const Flags& flags, const engine::ModelConfig& config, GpuModel& gpu,
                           int64_t length, int64_t r, double* forward_ms,
                           engine::ModelState* prefix_state) {
  const int64_t prefix = (length - 1) / flags.chunk * flags.chunk;
  if (r == 0) {
    PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(0));
    *forward_ms = 0;
    if (length <= flags.forward_max) {
      const int64_t started = NowNs();
      for (int64_t from = 0; from < prefix; from += flags.chunk) {
        PDSERVE_RETURN_IF_ERROR(
            gpu.Forward(0, ChunkTokens(config, from, from + flags.chunk), 0, ChunkRows(flags))
                .status());
      }
      *forward_ms = static_cast<double>(NowNs() - started) / 1e6;
    } else if (prefix > 0) {
      PDSERVE_RETURN_IF_ERROR(gpu.ImportState(
          0, RandomRingState(config, gpu.max_context(), prefix,
                             88172645463325252ull ^ static_cast<uint64_t>(length))));
    }
    Progress("prefill", length, r, "prefix state made");
    if (flags.prefix_slot != 0) {
      PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(1));
      PDSERVE_RETURN_IF_ERROR(gpu.CopySlot(0, 1));
    } else {
      PDSERVE_ASSIGN_OR_RETURN(*prefix_state, gpu.ExportState(0));
    }
    Progress("prefill", length, r, "prefix state exported");
  } else if (flags.prefix_slot != 0) {
    PDSERVE_RETURN_IF_ERROR(gpu.CopySlot(1, 0));
  } else {
    PDSERVE_RETURN_IF_ERROR(gpu.ImportState(0, *prefix_state));
  }
  Progress("prefill", length, r, "prefix restored");
  return absl::OkStatus();
}

// ---- prefill (child) --------------------------------------------------------------------------

absl::Status Prefill(const Flags& flags, Channel& channel) {
  PDSERVE_ASSIGN_OR_RETURN(Side side, MakeSide(flags, "prefill"));
  const engine::ModelConfig& config = side.config;
  std::unique_ptr<GpuModel>& gpu = side.gpu;
  const serving::StateLayout& layout = side.layout;
  const std::vector<kv::LayerAttention>& layers = side.layers;
  const auto fit = static_cast<int64_t>(runtime::GpuPrefillEngine::kStagingBudgetBytes /
                                        gpu->StagingLayerBytes());
  PDSERVE_ASSIGN_OR_RETURN(auto staging,
                           gpu->NewStateStaging(std::clamp<int64_t>(
                               fit, std::min<int64_t>(2, flags.layers), flags.layers)));
  PDSERVE_ASSIGN_OR_RETURN(auto transport,
                           kv::UcxTransport::Create(Lanes(flags), flags.post_on_lanes));
  SystemClock clock;
  TaskPool pool(HostThreads(flags));
  cudaEvent_t chunk_events[2];
  for (cudaEvent_t& e : chunk_events) {
    PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&e), "event"));
  }
  kv::SenderOptions sender_options{
      .max_in_flight_bytes = flags.window_mib > 0 ? static_cast<size_t>(flags.window_mib) << 20
                                                  : kv::InFlightBytesForLanes(Lanes(flags)),
      .checksum_pool = &pool};
  for (int64_t length : Lengths(flags)) {
    PDSERVE_ASSIGN_OR_RETURN(Pages pages,
                             MakePages(layout, layers, length, length + 1, flags.shm_pull));
    std::unique_ptr<kv::shm::PullSender> puller;
    if (flags.shm_pull) {
      PDSERVE_ASSIGN_OR_RETURN(puller, kv::shm::PullSender::Create(*pages.region));
    }
    sender_options.shm_pull = puller.get();
    kv::TransferSender sender(*transport, clock, sender_options);
    const runtime::PagedState paged(config, layout, length + 1);
    double forward_ms = 0;
    engine::ModelState prefix_state;
    for (int64_t r = 0; r < flags.warmup + flags.repeats; ++r) {
      PDSERVE_ASSIGN_OR_RETURN(const kv::Ticket ticket, kv::DecodeTicket(Unhex(channel.Read())));
      const int64_t prefix = (length - 1) / flags.chunk * flags.chunk;
      PDSERVE_RETURN_IF_ERROR(
          RestorePrefix(flags, config, *gpu, length, r, &forward_ms, &prefix_state));
      const std::vector<int32_t> last = ChunkTokens(config, prefix, length);
      std::vector<kv::SourcePage> sources;
      for (const kv::PlannedPage& page : pages.plan) {
        PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> bytes, pages.pool->Data(1, page.handle));
        sources.push_back({bytes, page.descriptor.element});
      }
      // Prepared before the chunk, as the prefill worker prepares before its prefill.
      PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<kv::Transfer> transfer,
                               sender.PrepareWithElements(ticket, std::move(sources)));
      if (flags.shm_pull && !transfer->pulled()) return transfer->pull_refusal();
      // Each layer is posted as soon as it is stored, as the prefill worker's callback does.
      auto post = [&](int64_t layer) -> absl::Status {
        PDSERVE_RETURN_IF_ERROR(transfer->PostLayer(static_cast<uint32_t>(layer)));
        return transfer->Poll().status();
      };
      runtime::StagedStoreTimes times;
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaDeviceSynchronize(), "sync"));
      // t0, the end of the chunk's compute, from events around it on the model's stream (with
      // --overlap the host is still storing when the device finishes).
      const auto stream = static_cast<cudaStream_t>(gpu->cuda_stream());
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(chunk_events[0], stream), "event"));
      const int64_t chunk_started = NowNs();
      int64_t stored = 0;
      int64_t finish_ns = 0;  // FinishForward's host time (its wait for the device included)
      if (flags.overlap) {
        // What GpuPrefillEngine::Run does on one GPU: the stores run during the chunk.
        PDSERVE_RETURN_IF_ERROR(
            gpu->BeginForwardExporting(0, last, staging.get(), ChunkRows(flags)));
        PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(chunk_events[1], stream), "event"));
        const absl::Status store =
            runtime::StoreSlotStaged(*gpu, 0, *staging, paged, pages.pages, post, &pool, &times);
        stored = NowNs();
        const int64_t finish_started = NowNs();
        PDSERVE_RETURN_IF_ERROR(gpu->FinishForward().status());
        finish_ns = NowNs() - finish_started;
        PDSERVE_RETURN_IF_ERROR(store);
      } else {
        PDSERVE_RETURN_IF_ERROR(gpu->Forward(0, last, 0, ChunkRows(flags)).status());
        PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(chunk_events[1], stream), "event"));
        PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(chunk_events[1]), "event"));
      }
      float chunk_ms = 0;
      PDSERVE_RETURN_IF_ERROR(CudaStatus(
          cudaEventElapsedTime(&chunk_ms, chunk_events[0], chunk_events[1]), "event time"));
      const double last_chunk_ms = chunk_ms;
      if (r == 0 && length <= flags.forward_max) forward_ms += last_chunk_ms;
      // The last layer's compute is done (the chunk's device time after its start).
      const int64_t t0 = chunk_started + static_cast<int64_t>(chunk_ms * 1e6);
      if (!flags.overlap) {
        PDSERVE_RETURN_IF_ERROR(
            runtime::StoreSlotStaged(*gpu, 0, *staging, paged, pages.pages, post, &pool, &times));
        stored = NowNs();
      }
      PDSERVE_RETURN_IF_ERROR(transfer->Commit(static_cast<int32_t>(length), 0));
      absl::StatusOr<bool> done = false;
      while (done.ok() && !*done) done = transfer->Poll();
      PDSERVE_RETURN_IF_ERROR(done.status());
      const int64_t delivered = NowNs();  // the commit's send completed
      PDSERVE_RETURN_IF_ERROR(transfer->Release());
      // The slot's digest once per length (an export of the whole slot: slow at long contexts).
      uint64_t digest = 0;
      if (r == 0) {
        PDSERVE_ASSIGN_OR_RETURN(digest, StateDigest(*gpu));
      }
      Progress("prefill", length, r, "sent");
      channel.Write(absl::StrCat(t0, " ", forward_ms, " ", digest, " ", stored, " ",
                                 times.copy_wait_ms, " ", times.store_ms, " ",
                                 times.stored_callback_ms, " ", delivered, " ", last_chunk_ms, " ",
                                 static_cast<double>(finish_ns) / 1e6));
    }
  }
  return absl::OkStatus();
}

// ---- decode (parent) --------------------------------------------------------------------------

// The decode side after the verified outcome with --early-import: tells the importer, waits
// until every layer's copy landed (kReady), takes the import and finishes it in slot 0 (what the
// decode runner's Place does for an early-imported sequence).
absl::Status EarlyImportDone(runtime::EarlyImporter& importer, runtime::GpuSlotImporter& slots,
                             runtime::ModelLock& lock) {
  importer.Verified(1);
  for (;;) {
    PDSERVE_ASSIGN_OR_RETURN(const bool ready, importer.Ready(1));
    if (ready) break;
    absl::SleepFor(absl::Microseconds(20));
  }
  PDSERVE_RETURN_IF_ERROR(importer.Take(1));
  lock.LockForStep();
  const absl::Status finished = slots.Finish(1);
  lock.Unlock();
  return finished;
}

// The decode side's table: its header, and one row per prompt length from the repeats'
// timings (Row::Add per repeat, with the prefill process's line) and the forward time estimate
// carried from the longest measured length to the longer ones.
void PrintHeader() {
  std::printf(
      "| prompt tokens | layers | lanes | host threads | bytes on the wire (bf16) | copy wait ms | "
      "store ms | post ms | send drain ms | verify lag ms | transfer ms | transfer GB/s | "
      "import ms | old import ms | end-to-end GB/s | copy floor GB/s (D2H + H2D) | "
      "end-to-end / floor | forward ms | left after compute ms | share of TTFT | state | "
      "overlap | last chunk ms | chunk logits | finish forward ms | early import | path | "
      "end-to-end ms (median) | end-to-end ms (min) | best end-to-end GB/s | first use ms | "
      "warm-up + measured |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
      "| --- | --- |\n");
  std::fflush(stdout);
}

struct ForwardEstimate {
  double longest_ms = 0;
  int64_t longest_tokens = 0;
};

struct Row {
  std::vector<double> transfer_ms, wait_ms, store_ms, post_ms, drain_ms, lag_ms, import_ms,
      old_import_ms, forward_ms, last_ms, finish_ms;
  std::vector<double> end_to_end_ms;  // t_imported - t0 of each measured transfer
  double first_use_ms = -1;           // the same of the first (warm-up) transfer
  bool same_state = true;
  uint64_t digest = 0;  // the decode slot's, from the first transfer

  // One transfer: the prefill process's line ("t0 forward_ms digest stored copy_wait store post
  // delivered last_chunk_ms finish_ms"), the decode side's verified and imported times and, on
  // the first transfer, the model whose slot 0 is compared with the prefill's digest. A warm-up
  // (not `measured`) adds only the state's comparison and, the first one, first_use_ms.
  absl::Status Add(const std::string& line, int64_t verified, int64_t imported, GpuModel* gpu,
                   bool measured) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ');
    if (fields.size() != 10) return absl::InternalError("bad line from the prefill process");
    const int64_t t0 = std::stoll(fields[0]);
    if (gpu != nullptr) {
      PDSERVE_ASSIGN_OR_RETURN(digest, StateDigest(*gpu));
      same_state = same_state && digest == std::stoull(fields[2]);
    }
    if (first_use_ms < 0) first_use_ms = static_cast<double>(imported - t0) / 1e6;
    if (!measured) return absl::OkStatus();
    end_to_end_ms.push_back(static_cast<double>(imported - t0) / 1e6);
    forward_ms.push_back(std::stod(fields[1]));
    transfer_ms.push_back(static_cast<double>(verified - t0) / 1e6);
    wait_ms.push_back(std::stod(fields[4]));
    last_ms.push_back(std::stod(fields[8]));
    finish_ms.push_back(std::stod(fields[9]));
    store_ms.push_back(std::stod(fields[5]));
    post_ms.push_back(std::stod(fields[6]));
    drain_ms.push_back(static_cast<double>(std::stoll(fields[7]) - std::stoll(fields[3])) / 1e6);
    lag_ms.push_back(static_cast<double>(verified - std::stoll(fields[7])) / 1e6);
    import_ms.push_back(static_cast<double>(imported - verified) / 1e6);
    return absl::OkStatus();
  }

  // Prints the row; DataLoss when the decode slot's state differed from the prefill's.
  absl::Status Print(const Flags& flags, int64_t length, uint64_t bytes, double floor,
                     ForwardEstimate& estimate, const char* path) const {
    if (transfer_ms.empty()) return absl::InvalidArgumentError("no measured transfer (--repeats)");
    const double transfer = Median(transfer_ms);
    const double import = Median(import_ms);
    const double best = *std::min_element(end_to_end_ms.begin(), end_to_end_ms.end());
    const double old_import = old_import_ms.empty() ? 0 : Median(old_import_ms);
    const double left = transfer + import;
    const double e2e = static_cast<double>(bytes) / (left / 1e3) / 1e9;
    double forward = Median(forward_ms);
    std::string forward_text = absl::StrFormat("%.1f", forward);
    if (forward > 0) {
      estimate.longest_ms = forward;
      estimate.longest_tokens = length;
    } else if (estimate.longest_tokens > 0) {
      forward = estimate.longest_ms * static_cast<double>(length) /
                static_cast<double>(estimate.longest_tokens);
      forward_text = absl::StrFormat("%.1f est.", forward);
    }
    const std::string share =
        forward > 0 ? absl::StrFormat("%.1f%%", 100 * left / (forward + left)) : "n/a";
    std::printf(
        "| %lld | %lld | %d | %d | %.1f MB | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f "
        "| %.2f | %.2f | %.2f | %.0f%% | %s | %.2f | %s | %s | %s | %.2f | %s | %.2f | %s | %s "
        "| %.3f | %.3f | %.2f | %.3f | %lld + %zu |\n",
        static_cast<long long>(length), static_cast<long long>(flags.layers), Lanes(flags),
        HostThreads(flags), static_cast<double>(bytes) / 1e6, Median(wait_ms), Median(store_ms),
        Median(post_ms), Median(drain_ms), Median(lag_ms), transfer,
        static_cast<double>(bytes) / (transfer / 1e3) / 1e9, import, old_import, e2e, floor,
        100 * e2e / floor, forward_text.c_str(), left, share.c_str(),
        same_state ? "equal" : "DIFFERS", flags.overlap && !flags.cuda_ipc ? "yes" : "no",
        Median(last_ms), ChunkRows(flags) == engine::gpu::ChunkLogits::kLastRow ? "last" : "all",
        Median(finish_ms), flags.early_import ? "yes" : "no", path, Median(end_to_end_ms), best,
        static_cast<double>(bytes) / (best / 1e3) / 1e9, first_use_ms,
        static_cast<long long>(flags.warmup), end_to_end_ms.size());
    std::fflush(stdout);
    if (!same_state) return absl::DataLossError("the decode slot's state differs from prefill's");
    return absl::OkStatus();
  }
};

// Progresses `receiver` until ticket `ticket_id` is decided; OK once verified, else its status.
absl::Status AwaitVerified(const Flags& flags, kv::TransferReceiver& receiver, uint64_t ticket_id) {
  absl::StatusOr<kv::TransferOutcome> outcome = receiver.Outcome(ticket_id);
  while (outcome.ok() && outcome->state == kv::TransferState::kReceiving) {
    receiver.Progress();
    // With several lanes their threads land the pages under the receiver's mutex; polling it
    // back to back would compete with them for it.
    if (Lanes(flags) > 1) absl::SleepFor(absl::Microseconds(50));
    outcome = receiver.Outcome(ticket_id);
  }
  PDSERVE_RETURN_IF_ERROR(outcome.status());
  return outcome->state == kv::TransferState::kVerified ? absl::OkStatus() : outcome->status;
}

absl::Status Decode(const Flags& flags, Channel& channel) {
  PDSERVE_ASSIGN_OR_RETURN(Side side, MakeSide(flags, "decode"));
  const engine::ModelConfig& config = side.config;
  std::unique_ptr<GpuModel>& gpu = side.gpu;
  const serving::StateLayout& layout = side.layout;
  const std::vector<kv::LayerAttention>& layers = side.layers;
  PDSERVE_ASSIGN_OR_RETURN(auto staging, gpu->NewStateStaging(std::min<int64_t>(2, flags.layers)));
  SystemClock clock;
  // With --early-import: the receiver reports each layer whose pages all landed and passed their
  // checksums to the running transfer's importer, as the decode worker's receiver does.
  std::atomic<runtime::EarlyImporter*> early{nullptr};
  std::atomic<uint64_t> receiving{0};
  auto on_layer = [&](uint64_t, uint64_t request_id, uint32_t layer) {
    runtime::EarlyImporter* importer = early.load();
    if (importer != nullptr && request_id == receiving.load()) importer->LayerArrived(1, layer);
  };
  std::unique_ptr<kv::shm::AckTable> acks;
  if (flags.shm_pull) {
    PDSERVE_ASSIGN_OR_RETURN(acks, kv::shm::AckTable::Create(uint64_t{1} << 20));
  }
  PDSERVE_ASSIGN_OR_RETURN(
      auto receiver,
      kv::CreateUcxReceiver(
          {.lease = absl::Seconds(600), .on_layer = on_layer, .acks = acks.get()}, clock,
          [](uint64_t, uint64_t, const absl::Status&) {}, nullptr, Lanes(flags)));
  TaskPool pool(HostThreads(flags));
  runtime::ModelLock model_lock;
  PrintHeader();
  ForwardEstimate estimate;
  uint64_t request = 1;
  for (int64_t length : Lengths(flags)) {
    PDSERVE_ASSIGN_OR_RETURN(Pages pages, MakePages(layout, layers, length, length + 1));
    const runtime::PagedState paged(config, layout, length + 1);
    // The early import into slot 0 from this length's pages (sequence 1 of its pool).
    PDSERVE_ASSIGN_OR_RETURN(
        std::unique_ptr<runtime::GpuSlotImporter> slots,
        runtime::GpuSlotImporter::Create(
            {.gpu = gpu.get(),
             .layout = &layout,
             .pool = pages.pool.get(),
             .lock = &model_lock,
             .take_slot = [](serving::RequestId) -> absl::StatusOr<int64_t> { return 0; },
             .return_slot = [](serving::RequestId, int64_t) {},
             .fill_pool = &pool}));
    runtime::EarlyImporter importer(slots.get(), flags.layers);
    early.store(flags.early_import ? &importer : nullptr);
    // The receiver outlives this length's importer (also on an error return).
    struct Unset {
      std::atomic<runtime::EarlyImporter*>& early;
      ~Unset() { early.store(nullptr); }
    } unset{early};
    Row row;
    uint64_t bytes = 0;
    for (int64_t r = 0; r < flags.warmup + flags.repeats; ++r) {
      kv::ReceiveSpec spec{.request_id = request++, .epoch = kv::TableEpoch(pages.table)};
      bytes = 0;
      for (const kv::PlannedPage& page : pages.plan) {
        spec.pages.push_back(page.descriptor);
        PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> destination,
                                 pages.pool->Data(1, page.handle));
        spec.destinations.push_back(destination);
        bytes += page.descriptor.bytes;
      }
      receiving.store(spec.request_id);
      PDSERVE_ASSIGN_OR_RETURN(const kv::Ticket ticket, receiver->Expect(std::move(spec)));
      // The slot and its device pages are claimed with the ticket, as at the decode worker's
      // Reserve.
      if (flags.early_import) PDSERVE_RETURN_IF_ERROR(importer.Begin(1, length, length + 1));
      channel.Write(Hex(kv::EncodeTicket(ticket)));
      PDSERVE_RETURN_IF_ERROR(AwaitVerified(flags, *receiver, ticket.ticket_id));
      const int64_t verified = NowNs();
      if (flags.early_import) {
        // Most layers are in the slot already; runnable once the last copies landed.
        PDSERVE_RETURN_IF_ERROR(EarlyImportDone(importer, *slots, model_lock));
      } else {
        // The direct import (GpuStepRunner::Place's): straight from the pages into the slot.
        PDSERVE_RETURN_IF_ERROR(gpu->ImportLayers(
            0, length, staging.get(),
            [&](int64_t layer, const engine::RingLayerGeometry& geometry,
                const engine::MutableRingLayerBlocks& blocks) {
              return paged.LoadLayerRing(layer, geometry, length, pages.pages, blocks, &pool);
            }));
      }
      const int64_t imported = NowNs();
      PDSERVE_RETURN_IF_ERROR(row.Add(channel.Read(), verified, imported,
                                      r == 0 ? gpu.get() : nullptr, r >= flags.warmup));
      Progress("decode", length, r, "imported");
      if (!flags.old_import || (r > 0 && r < flags.warmup)) continue;
      // The previous path, for the record: PagedState::Load into a CPU-layout state, then
      // ImportState through the same staging; it must give the same slot.
      const int64_t old_started = NowNs();
      engine::ModelState state = gpu->NewState();
      PDSERVE_RETURN_IF_ERROR(paged.Load(length, pages.pages, &state));
      PDSERVE_RETURN_IF_ERROR(gpu->ImportState(0, state, staging.get()));
      if (r >= flags.warmup) {
        row.old_import_ms.push_back(static_cast<double>(NowNs() - old_started) / 1e6);
      }
      if (r == 0) {
        PDSERVE_ASSIGN_OR_RETURN(const uint64_t old_digest, StateDigest(*gpu));
        row.same_state = row.same_state && old_digest == row.digest;
      }
      // The ticket is verified and read: it is forgotten at its lease end; the pages are reused
      // by the next repeat (a new ticket over the same pages, as a benchmark may).
    }
    PDSERVE_ASSIGN_OR_RETURN(const double floor, CopyFloor(bytes));
    PDSERVE_RETURN_IF_ERROR(row.Print(flags, length, bytes, floor, estimate,
                                      flags.shm_pull ? "shm pull" : "active messages"));
  }
  return absl::OkStatus();
}

// ---- CUDA IPC (--cuda-ipc) ----------------------------------------------------------------------
//
// The same-host device-to-device path through the product's protocol classes (docs/protocol.md,
// "Same-host device-to-device pages (CUDA IPC)"): the prefill process's pages live in its GPU
// arena (an IpcPageArena carved by a PagePool, no host bytes), a runtime::DeviceStatePages made
// for the transfer (as the workers make one a request) writes every layer's pages and their XXH3
// there after the chunk's forward, and TransferSender::PrepareDevice (before the chunk with
// --prepare-early, its checksums set after the store) sends page references to them; the decode
// process's receiver lands them in its own device pages (ReceiveSpec::device_pci_bus_id, one
// kv::cuda_ipc::CudaPageLander per lane: one copy-and-checksum launch per lane progress) and
// (--early-import) each verified layer goes into slot 0 as it lands (EarlyImporter over
// GpuSlotImporter::ClaimFromDevice, the decode worker's way), else once all verified
// DeviceStatePages::ImportSlot(Batched) copies them. PDSERVE_DEVICE_PAGES=fresh: the
// DeviceStatePages' buffers its own (the workers' behaviour before the kept descriptors).

// A PagePool whose page bytes are GPU memory at `block` (never touched by the host).
absl::StatusOr<std::unique_ptr<serving::PagePool>> DevicePool(const serving::StateLayout& layout,
                                                              int64_t total,
                                                              std::span<std::byte> block) {
  serving::PagePoolOptions options = layout.PoolOptions(1, total);
  options.poison_freed = false;
  options.host_block = block;
  return serving::PagePool::Create(std::move(options));
}

// The device page addresses of `table` (sequence 1 of `pool`), as DeviceStatePages takes them.
absl::StatusOr<runtime::DeviceSequencePages> DeviceAddresses(serving::PagePool& pool,
                                                             const serving::PageTable& table) {
  runtime::DeviceSequencePages pages;
  for (const std::vector<serving::PageHandle>& kind : table.pages) {
    pages.pages.emplace_back();
    for (const serving::PageHandle& handle : kind) {
      PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> bytes, pool.Data(1, handle));
      pages.pages.back().push_back(bytes.data());
    }
  }
  return pages;
}

// One sequence of `length` + 1 tokens in GPU pages at `block` (PagePool bookkeeping; its page
// table, transfer plan and device page addresses).
struct DeviceSequence {
  std::unique_ptr<serving::PagePool> pool;
  serving::PageTable table;
  std::vector<kv::PlannedPage> plan;
  runtime::DeviceSequencePages pages;
};

// The DeviceStatePages of one transfer, made per transfer as the workers make one per request
// (GpuPrefillEngine::RunToDevice, GpuSlotImporter::ClaimFromDevice): over `descriptors` (kept
// across transfers, runtime::KeepDevicePageBuffers) or, null, buffers of its own (the workers'
// behaviour with PDSERVE_DEVICE_PAGES=fresh).
absl::StatusOr<std::unique_ptr<runtime::DeviceStatePages>> TransferPages(
    Side& side, int64_t length, std::shared_ptr<runtime::DevicePageDescriptors> descriptors) {
  return runtime::DeviceStatePages::Create(side.gpu.get(), side.layout, length + 1,
                                           std::move(descriptors));
}

// The workers' kept descriptor ring for side.gpu (null with PDSERVE_DEVICE_PAGES=fresh).
absl::StatusOr<std::shared_ptr<runtime::DevicePageDescriptors>> KeptDescriptors(
    const Flags& flags) {
  if (!runtime::KeepDevicePageBuffers()) return nullptr;
  return runtime::DevicePageDescriptors::Create(static_cast<size_t>(2 * flags.layers),
                                                /*mapped=*/true);
}
absl::StatusOr<DeviceSequence> MakeDeviceSequence(Side& side, int64_t length,
                                                  std::span<std::byte> block) {
  const int64_t total = length + 1;
  DeviceSequence d;
  PDSERVE_ASSIGN_OR_RETURN(d.pool, DevicePool(side.layout, total, block));
  PDSERVE_ASSIGN_OR_RETURN(d.table, d.pool->Allocate(1, side.layout.Demand(total)));
  PDSERVE_ASSIGN_OR_RETURN(d.plan,
                           kv::PlanTransfer(side.layout, side.layers, d.table, length, total));
  PDSERVE_ASSIGN_OR_RETURN(d.pages, DeviceAddresses(*d.pool, d.table));
  return d;
}

// Per layer, the PageIds (state kind, index in the table's pages of that kind) of the plan's
// pages of that layer, in slot order, and the slots they are: which pages StoreLayer checksums,
// in the order the sender needs them.
struct LayerChecksums {
  std::vector<runtime::PagedState::PageId> ids;
  std::vector<size_t> slots;
};
absl::StatusOr<std::vector<LayerChecksums>> PlanChecksums(const serving::StateLayout& layout,
                                                          const serving::PageTable& table,
                                                          const std::vector<kv::PlannedPage>& plan,
                                                          int64_t layers) {
  std::vector<LayerChecksums> out(static_cast<size_t>(layers));
  for (size_t slot = 0; slot < plan.size(); ++slot) {
    const serving::PageHandle& handle = plan[slot].handle;
    std::optional<serving::StateKind> kind;
    for (int k = 0; k < serving::kNumStateKinds; ++k) {
      const auto candidate = static_cast<serving::StateKind>(k);
      if (layout.KindIndex(candidate) == handle.kind) kind = candidate;
    }
    const std::vector<serving::PageHandle>& pages = table.pages[static_cast<size_t>(handle.kind)];
    const auto at = std::find(pages.begin(), pages.end(), handle);
    if (!kind.has_value() || at == pages.end() || plan[slot].descriptor.layer >= layers) {
      return absl::InternalError(absl::StrCat("plan slot ", slot, " is not a page of the table"));
    }
    LayerChecksums& layer = out[plan[slot].descriptor.layer];
    layer.ids.push_back({*kind, static_cast<int64_t>(at - pages.begin())});
    layer.slots.push_back(slot);
  }
  return out;
}

absl::Status PrefillIpc(const Flags& flags, Channel& channel) {
  PDSERVE_ASSIGN_OR_RETURN(Side side, MakeSide(flags, "prefill"));
  const engine::ModelConfig& config = side.config;
  std::unique_ptr<GpuModel>& gpu = side.gpu;
  const serving::StateLayout& layout = side.layout;
  PDSERVE_ASSIGN_OR_RETURN(auto transport,
                           kv::UcxTransport::Create(Lanes(flags), flags.post_on_lanes));
  SystemClock clock;
  cudaEvent_t chunk_events[2];
  for (cudaEvent_t& e : chunk_events) {
    PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&e), "event"));
  }
  // PullSender holds the ack tables it maps; its own page region is not used (no host pages).
  PDSERVE_ASSIGN_OR_RETURN(auto unused_region,
                           kv::shm::SharedRegion::Create(kv::shm::kPagesPurpose, 4096));
  PDSERVE_ASSIGN_OR_RETURN(auto puller, kv::shm::PullSender::Create(*unused_region));
  kv::TransferSender sender(
      *transport, clock,
      {.max_in_flight_bytes = flags.window_mib > 0 ? static_cast<size_t>(flags.window_mib) << 20
                                                   : kv::InFlightBytesForLanes(Lanes(flags)),
       .path = "cuda-ipc",
       .shm_pull = puller.get(),
       .device_ref_version = flags.refs});
  const auto stream = static_cast<cudaStream_t>(gpu->cuda_stream());
  PDSERVE_ASSIGN_OR_RETURN(const std::shared_ptr<runtime::DevicePageDescriptors> descriptors,
                           KeptDescriptors(flags));
  for (int64_t length : Lengths(flags)) {
    const int64_t total = length + 1;
    const size_t bytes = serving::PagePool::HostBytesNeeded(layout.PoolOptions(1, total));
    PDSERVE_ASSIGN_OR_RETURN(auto arena, kv::cuda_ipc::IpcPageArena::Create(0, bytes));
    const std::span<std::byte> block(static_cast<std::byte*>(arena->data()), bytes);
    PDSERVE_ASSIGN_OR_RETURN(DeviceSequence sequence, MakeDeviceSequence(side, length, block));
    serving::PagePool* pool = sequence.pool.get();
    const serving::PageTable& table = sequence.table;
    const std::vector<kv::PlannedPage>& plan = sequence.plan;
    const runtime::DeviceSequencePages& device_pages = sequence.pages;
    PDSERVE_ASSIGN_OR_RETURN(const std::vector<LayerChecksums> checks,
                             PlanChecksums(layout, table, plan, flags.layers));
    std::vector<runtime::PagedState::PageId> all_ids;  // Every layer's, in the sums' order.
    for (const LayerChecksums& c : checks)
      all_ids.insert(all_ids.end(), c.ids.begin(), c.ids.end());
    engine::gpu::DeviceArray<uint64_t> sums;
    engine::gpu::PinnedArray<uint64_t> host_sums;
    PDSERVE_RETURN_IF_ERROR(sums.Allocate(plan.size()));
    PDSERVE_RETURN_IF_ERROR(host_sums.Allocate(plan.size()));
    double forward_ms = 0;
    engine::ModelState prefix_state;
    // The references without their checksums (DevicePages::checksums_pending with
    // --prepare-early, as the prefill worker prepares before the prompt runs).
    kv::DevicePages unsummed{.arena = kv::cuda_ipc::NameOf(arena->handle())};
    unsummed.pages.resize(plan.size());
    for (size_t slot = 0; slot < plan.size(); ++slot) {
      PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> page, pool->Data(1, plan[slot].handle));
      unsummed.pages[slot].offset = static_cast<uint64_t>(page.data() - block.data());
      unsummed.pages[slot].length = plan[slot].descriptor.bytes;
      unsummed.pages[slot].element = plan[slot].descriptor.element;
    }
    for (int64_t r = 0; r < flags.warmup + flags.repeats; ++r) {
      if (r == 0) {
        // The decode side measures floor (a) while this process waits for the first ticket.
        if (channel.Read() != "floor") return absl::InternalError("expected 'floor'");
        channel.Write("idle");
      }
      PDSERVE_ASSIGN_OR_RETURN(const kv::Ticket ticket, kv::DecodeTicket(Unhex(channel.Read())));
      PDSERVE_RETURN_IF_ERROR(
          RestorePrefix(flags, config, *gpu, length, r, &forward_ms, &prefix_state));
      const int64_t prefix = (length - 1) / flags.chunk * flags.chunk;
      const std::vector<int32_t> last = ChunkTokens(config, prefix, length);
      std::unique_ptr<kv::Transfer> transfer;
      if (flags.prepare_early) {
        kv::DevicePages pending = unsummed;
        pending.checksums_pending = true;
        PDSERVE_ASSIGN_OR_RETURN(transfer, sender.PrepareDevice(ticket, std::move(pending)));
      }
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaDeviceSynchronize(), "sync"));
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(chunk_events[0], stream), "event"));
      const int64_t chunk_started = NowNs();
      PDSERVE_RETURN_IF_ERROR(gpu->Forward(0, last, 0, ChunkRows(flags)).status());
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(chunk_events[1], stream), "event"));
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(chunk_events[1]), "event"));
      float chunk_ms = 0;
      PDSERVE_RETURN_IF_ERROR(CudaStatus(
          cudaEventElapsedTime(&chunk_ms, chunk_events[0], chunk_events[1]), "event time"));
      if (r == 0 && length <= flags.forward_max) forward_ms += chunk_ms;
      const int64_t t0 = chunk_started + static_cast<int64_t>(chunk_ms * 1e6);
      // Every layer's pages into the arena and their checksums, on the model's stream, then the
      // checksums to the host (the only bytes of the state the host reads), as RunToDevice: its
      // DeviceStatePages made for the transfer (over the kept descriptors, or with
      // PDSERVE_DEVICE_PAGES=fresh its own buffers and checksum arrays, freed at its end).
      const int64_t store_started = NowNs();
      std::vector<uint64_t> fresh_host;
      uint64_t* host = host_sums.get();
      {
        PDSERVE_ASSIGN_OR_RETURN(const auto store, TransferPages(side, length, descriptors));
        engine::gpu::DeviceArray<uint64_t> fresh_sums;
        uint64_t* device_sums = sums.get();
        if (descriptors == nullptr) {
          PDSERVE_RETURN_IF_ERROR(fresh_sums.Allocate(plan.size()));
          device_sums = fresh_sums.get();
          fresh_host.resize(plan.size());
          host = fresh_host.data();
        }
        size_t at = 0;
        if (flags.store_all) {
          PDSERVE_RETURN_IF_ERROR(
              store->StoreLayers(0, length, device_pages, {all_ids, device_sums}));
          at = all_ids.size();
        }
        for (int64_t l = 0; l < flags.layers && !flags.store_all; ++l) {
          const LayerChecksums& c = checks[static_cast<size_t>(l)];
          PDSERVE_RETURN_IF_ERROR(
              store->StoreLayer(0, l, length, device_pages, {c.ids, device_sums + at}));
          at += c.ids.size();
        }
        PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host, device_sums, at * sizeof(uint64_t),
                                                           cudaMemcpyDeviceToHost, stream),
                                           "checksums"));
        PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "store"));
      }
      const int64_t stored = NowNs();
      std::vector<uint64_t> by_slot(plan.size());
      size_t at = 0;
      for (const LayerChecksums& c : checks) {
        for (size_t slot : c.slots) by_slot[slot] = host[at++];
      }
      if (flags.prepare_early) {
        PDSERVE_RETURN_IF_ERROR(transfer->SetDeviceChecksums(by_slot));
      } else {
        kv::DevicePages sources = unsummed;
        for (size_t slot = 0; slot < plan.size(); ++slot) sources.pages[slot].xxh3 = by_slot[slot];
        PDSERVE_ASSIGN_OR_RETURN(transfer, sender.PrepareDevice(ticket, std::move(sources)));
      }
      PDSERVE_RETURN_IF_ERROR(transfer->PostAll());
      const int64_t posted = NowNs();
      PDSERVE_RETURN_IF_ERROR(transfer->Commit(static_cast<int32_t>(length), 0));
      absl::StatusOr<bool> done = false;
      while (done.ok() && !*done) done = transfer->Poll();
      PDSERVE_RETURN_IF_ERROR(done.status());
      const int64_t delivered = NowNs();
      PDSERVE_RETURN_IF_ERROR(transfer->Release());
      uint64_t digest = 0;
      if (r == 0) {
        PDSERVE_ASSIGN_OR_RETURN(digest, StateDigest(*gpu));
      }
      Progress("prefill", length, r, "sent (cuda ipc)");
      // The decode side's line: copy wait 0 (no host copy), store = the device pages and their
      // checksums, post = PrepareDevice + PostAll.
      channel.Write(absl::StrCat(t0, " ", forward_ms, " ", digest, " ", posted, " ", 0.0, " ",
                                 static_cast<double>(stored - store_started) / 1e6, " ",
                                 static_cast<double>(posted - stored) / 1e6, " ", delivered, " ",
                                 static_cast<double>(chunk_ms), " ", 0.0));
    }
  }
  return absl::OkStatus();
}

// Outcomes as the receiver decides them (its on_outcome, on a lane thread), so the decode side
// learns of a verified ticket within a spin, not a 50 us sleep and a hold of the receiver's
// mutex that competes with the lanes.
class Outcomes {
 public:
  void Decided(uint64_t ticket_id, const kv::TransferOutcome& outcome) {
    absl::MutexLock lock(&mu_);
    decided_[ticket_id] = outcome.state == kv::TransferState::kVerified ? absl::OkStatus()
                          : outcome.status.ok() ? absl::InternalError("not verified")
                                                : outcome.status;
    count_.fetch_add(1, std::memory_order_release);
  }
  // Waits for `ticket_id`'s outcome, progressing `receiver` once a millisecond (its lease
  // sweeps); OK when verified.
  absl::Status Await(kv::TransferReceiver& receiver, uint64_t ticket_id) {
    absl::Time next_sweep = absl::Now();
    for (uint64_t seen = ~uint64_t{0};;) {
      if (const uint64_t now = count_.load(std::memory_order_acquire); now != seen) {
        seen = now;
        absl::MutexLock lock(&mu_);
        if (auto it = decided_.find(ticket_id); it != decided_.end()) return it->second;
      }
      if (absl::Now() >= next_sweep) {
        receiver.Progress();
        next_sweep = absl::Now() + absl::Milliseconds(1);
      }
      std::this_thread::yield();
    }
  }

 private:
  absl::Mutex mu_;
  std::map<uint64_t, absl::Status> decided_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> count_{0};
};

absl::Status DecodeIpc(const Flags& flags, Channel& channel) {
  PDSERVE_ASSIGN_OR_RETURN(Side side, MakeSide(flags, "decode"));
  std::unique_ptr<GpuModel>& gpu = side.gpu;
  const serving::StateLayout& layout = side.layout;
  SystemClock clock;
  Outcomes outcomes;  // Before the receiver, which reports to it.
  // With --early-import: each layer whose pages landed and passed their checksums goes to the
  // running transfer's importer (GpuSlotImporter::ClaimFromDevice: DeviceStatePages::LoadLayer
  // a layer), as in the decode worker.
  std::atomic<runtime::EarlyImporter*> early{nullptr};
  std::atomic<uint64_t> receiving{0};
  auto on_layer = [&](uint64_t, uint64_t request_id, uint32_t layer) {
    runtime::EarlyImporter* importer = early.load();
    if (importer != nullptr && request_id == receiving.load()) importer->LayerArrived(1, layer);
  };
  PDSERVE_ASSIGN_OR_RETURN(auto acks, kv::shm::AckTable::Create(uint64_t{1} << 20));
  PDSERVE_ASSIGN_OR_RETURN(
      auto receiver, kv::CreateUcxReceiver(
                         {.lease = absl::Seconds(600), .on_layer = on_layer, .acks = acks.get()},
                         clock, [](uint64_t, uint64_t, const absl::Status&) {},
                         [&outcomes](uint64_t ticket_id, uint64_t, const kv::TransferOutcome& o) {
                           outcomes.Decided(ticket_id, o);
                         },
                         Lanes(flags)));
  auto arenas = std::make_shared<kv::cuda_ipc::PeerArenaCache>();
  PDSERVE_ASSIGN_OR_RETURN(const kv::cuda_ipc::LanderMode mode,
                           kv::cuda_ipc::ParseLanderMode(flags.lander));
  std::vector<const kv::cuda_ipc::CudaPageLander*> landers;  // Owned by the lanes.
  PDSERVE_RETURN_IF_ERROR(receiver->SetDeviceLanders(
      [&]() -> absl::StatusOr<std::unique_ptr<kv::shm::DevicePageLander>> {
        PDSERVE_ASSIGN_OR_RETURN(auto lander,
                                 kv::cuda_ipc::CudaPageLander::Create(0, arenas, mode));
        landers.push_back(lander.get());
        return std::unique_ptr<kv::shm::DevicePageLander>(std::move(lander));
      }));
  // Flushes of every lane's lander so far and their host time (read between transfers: the
  // lanes are idle then).
  auto flushes = [&] {
    uint64_t n = 0;
    for (const kv::cuda_ipc::CudaPageLander* lander : landers) n += lander->flushes();
    return n;
  };
  auto flush_time = [&] {
    absl::Duration d;
    for (const kv::cuda_ipc::CudaPageLander* lander : landers) d += lander->flush_time();
    return d;
  };
  char bus[32] = {};
  PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, 0), "bus id"));
  PrintHeader();
  const auto stream = static_cast<cudaStream_t>(gpu->cuda_stream());
  PDSERVE_ASSIGN_OR_RETURN(const std::shared_ptr<runtime::DevicePageDescriptors> descriptors,
                           KeptDescriptors(flags));
  runtime::ModelLock model_lock;
  ForwardEstimate estimate;
  uint64_t request = 1;
  for (int64_t length : Lengths(flags)) {
    const int64_t total = length + 1;
    const size_t block_bytes = serving::PagePool::HostBytesNeeded(layout.PoolOptions(1, total));
    engine::gpu::DeviceArray<std::byte> block;
    PDSERVE_RETURN_IF_ERROR(block.Allocate(block_bytes));
    PDSERVE_ASSIGN_OR_RETURN(DeviceSequence sequence,
                             MakeDeviceSequence(side, length, {block.get(), block_bytes}));
    serving::PagePool* pool = sequence.pool.get();
    const serving::PageTable& table = sequence.table;
    const std::vector<kv::PlannedPage>& plan = sequence.plan;
    const runtime::DeviceSequencePages& device_pages = sequence.pages;
    // The early import into slot 0 (the importer, and its descriptors, kept for the length as a
    // decode worker keeps its importer).
    PDSERVE_ASSIGN_OR_RETURN(
        std::unique_ptr<runtime::GpuSlotImporter> slots,
        runtime::GpuSlotImporter::Create(
            {.gpu = gpu.get(),
             .layout = &layout,
             .pool = pool,
             .lock = &model_lock,
             .take_slot = [](serving::RequestId) -> absl::StatusOr<int64_t> { return 0; },
             .return_slot = [](serving::RequestId, int64_t) {}}));
    runtime::EarlyImporter importer(slots.get(), flags.layers);
    early.store(flags.early_import ? &importer : nullptr);
    struct Unset {  // The receiver outlives this length's importer (also on an error return).
      std::atomic<runtime::EarlyImporter*>& early;
      ~Unset() { early.store(nullptr); }
    } unset{early};
    Row row;
    uint64_t bytes = 0;
    for (const kv::PlannedPage& page : plan) bytes += page.descriptor.bytes;
    // Floor (a) now, while the prefill process waits (at the end of a length its arena is freed
    // and the next one made: a floor measured then ran 18 GB/s against 26 in a quiet run).
    channel.Write("floor");
    if (channel.Read() != "idle") return absl::InternalError("expected 'idle'");
    PDSERVE_ASSIGN_OR_RETURN(const double floor, CopyFloor(bytes));
    uint64_t flushes_before = flushes();
    absl::Duration flush_time_before = flush_time();
    for (int64_t r = 0; r < flags.warmup + flags.repeats; ++r) {
      if (r == flags.warmup) {  // The lander counts of the measured transfers only.
        flushes_before = flushes();
        flush_time_before = flush_time();
      }
      kv::ReceiveSpec spec{
          .request_id = request++, .epoch = kv::TableEpoch(table), .device_pci_bus_id = bus};
      bytes = 0;
      for (const kv::PlannedPage& page : plan) {
        spec.pages.push_back(page.descriptor);
        PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> destination, pool->Data(1, page.handle));
        spec.destinations.push_back(destination);
        bytes += page.descriptor.bytes;
      }
      receiving.store(spec.request_id);
      PDSERVE_ASSIGN_OR_RETURN(const kv::Ticket ticket, receiver->Expect(std::move(spec)));
      // The slot claimed with the ticket, as at the decode worker's Reserve.
      if (flags.early_import) {
        PDSERVE_RETURN_IF_ERROR(
            importer.BeginFromDevice(1, length, total, {.pages = device_pages.pages}));
      }
      channel.Write(Hex(kv::EncodeTicket(ticket)));
      PDSERVE_RETURN_IF_ERROR(outcomes.Await(*receiver, ticket.ticket_id));
      const int64_t verified = NowNs();
      if (flags.early_import) {
        // Most layers are in the slot already; runnable once the last copies landed.
        PDSERVE_RETURN_IF_ERROR(EarlyImportDone(importer, *slots, model_lock));
      } else {
        // The verified device pages into slot 0, device to device, by a DeviceStatePages made
        // for the transfer (as the workers make one a request).
        PDSERVE_ASSIGN_OR_RETURN(const auto load, TransferPages(side, length, descriptors));
        PDSERVE_RETURN_IF_ERROR(flags.import_all ? load->ImportSlotBatched(0, length, device_pages)
                                                 : load->ImportSlot(0, length, device_pages));
      }
      PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "import"));
      const int64_t imported = NowNs();
      PDSERVE_RETURN_IF_ERROR(row.Add(channel.Read(), verified, imported,
                                      r == 0 ? gpu.get() : nullptr, r >= flags.warmup));
      Progress("decode", length, r, "imported (cuda ipc)");
    }
    const uint64_t batches = flushes() - flushes_before;
    const double flush_us = absl::ToDoubleMicroseconds(flush_time() - flush_time_before);
    std::fprintf(stderr,
                 "%lld tokens: %zu pages a transfer, %.1f lander flushes a transfer (%.1f pages "
                 "and %.1f us each)\n",
                 static_cast<long long>(length), plan.size(),
                 static_cast<double>(batches) / static_cast<double>(flags.repeats),
                 batches > 0 ? static_cast<double>(plan.size()) *
                                   static_cast<double>(flags.repeats) / static_cast<double>(batches)
                             : 0.0,
                 batches > 0 ? flush_us / static_cast<double>(batches) : 0.0);
    const std::string path = absl::StrCat(
        "cuda-ipc v", flags.refs, " ", flags.lander, flags.store_all ? " store-all" : "",
        flags.early_import ? " early-import" : (flags.import_all ? " import-all" : ""),
        runtime::KeepDevicePageBuffers() ? " kept-buffers" : " fresh-buffers",
        flags.prepare_early ? " prepare-early" : "");
    PDSERVE_RETURN_IF_ERROR(row.Print(flags, length, bytes, floor, estimate, path.c_str()));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app("CUDA prefill -> CUDA decode state transfer over UCX, two processes on one GPU");
  app.add_option("--layers", flags.layers, "V4-Flash-shaped layers (CSA / HCA alternating)");
  app.add_option("--lengths", flags.lengths, "Prompt lengths, comma-separated");
  app.add_option("--forward-max", flags.forward_max,
                 "Longest prompt run through a real forward (longer: a random state)");
  app.add_option("--chunk", flags.chunk, "Forward chunk tokens (the model's max_chunk)");
  app.add_option("--prefix-slot", flags.prefix_slot,
                 "1: keep the prompt's prefix state in slot 1 on the GPU (CopySlot a repeat); "
                 "0: on the host (ImportState a repeat)");
  app.add_option("--warmup", flags.warmup,
                 "Transfers per length before the measured ones (the first one's end-to-end is "
                 "the 'first use ms' column)");
  app.add_option("--repeats", flags.repeats, "Measured transfers per length (medians, best)");
  app.add_option("--lanes", flags.lanes,
                 "UCX lanes on each side (0: kv::DefaultTransferLanes of this host's cores)");
  app.add_option("--host-threads", flags.host_threads,
                 "Threads of the page store, checksums and import on each side (0: "
                 "DefaultTransferHostThreads of this host's cores)");
  app.add_option("--window-mib", flags.window_mib, "The sender's bytes in flight, MiB");
  app.add_option("--overlap", flags.overlap,
                 "Store and post the layers during the last chunk's compute "
                 "(BeginForwardExporting), as the CUDA prefill engine does");
  app.add_option("--post-on-lanes", flags.post_on_lanes,
                 "Post the page sends on the lane threads (0: on the prefill's thread)");
  app.add_option("--chunk-logits", flags.chunk_logits,
                 "Prompt chunks' logits brought to the host: all or last (default: "
                 "PDSERVE_GPU_CHUNK_LOGITS, as the serving paths)")
      ->check(CLI::IsMember({"all", "last"}));
  app.add_option("--early-import", flags.early_import,
                 "Claim the decode slot with the ticket and import each layer as its pages "
                 "arrive (runtime::EarlyImporter); 0: the direct import after verification");
  app.add_option("--shm-pull", flags.shm_pull,
                 "The decode process pulls the pages out of the prefill process's shared pool "
                 "(transfer.shm_pull); 0: active messages");
  app.add_option("--cuda-ipc", flags.cuda_ipc,
                 "Pages in the prefill process's GPU arena, landed device to device by the decode "
                 "process (CUDA IPC; the stores after the chunk)");
  app.add_option("--refs", flags.refs,
                 "With --cuda-ipc: page references of version 3 (compact batches) or 2")
      ->check(CLI::IsMember({2, 3}));
  app.add_option("--lander", flags.lander,
                 "With --cuda-ipc: the decode landers' descriptors and hashes copied on the "
                 "stream (staged), in pinned memory the kernels read and write (mapped), or that "
                 "with one copy-and-hash kernel (fused)")
      ->check(CLI::IsMember({"staged", "mapped", "fused"}));
  app.add_option("--store-all", flags.store_all,
                 "With --cuda-ipc: every layer's pages in one StoreLayers (0: StoreLayer a layer)");
  app.add_option("--import-all", flags.import_all,
                 "With --cuda-ipc: the import's fills and copies in two launches for all layers "
                 "(ImportSlotBatched; 0: ImportSlot)");
  app.add_option("--prepare-early", flags.prepare_early,
                 "With --cuda-ipc: PrepareDevice before the chunk, SetDeviceChecksums after the "
                 "store (the prefill worker's order); 0: PrepareDevice after the store");
  app.add_option("--old-import", flags.old_import,
                 "Also time the previous import (PagedState::Load + ImportState)");
  CLI11_PARSE(app, argc, argv);
  int to_prefill[2];
  int to_decode[2];
  if (pipe(to_prefill) != 0 || pipe(to_decode) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    pdserve::bench::Channel channel(to_prefill[0], to_decode[1]);
    const absl::Status status = flags.cuda_ipc ? pdserve::bench::PrefillIpc(flags, channel)
                                               : pdserve::bench::Prefill(flags, channel);
    if (!status.ok()) pdserve::bench::Die("prefill", status);
    _exit(0);
  }
  pdserve::bench::Channel channel(to_decode[0], to_prefill[1]);
  const absl::Status status = flags.cuda_ipc ? pdserve::bench::DecodeIpc(flags, channel)
                                             : pdserve::bench::Decode(flags, channel);
  if (!status.ok()) {
    kill(child, SIGTERM);
    pdserve::bench::Die("decode", status);
  }
  int wait_status = 0;
  waitpid(child, &wait_status, 0);
  return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 1;
}
