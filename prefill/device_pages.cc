// The prefill worker's side of the CUDA IPC path (docs/protocol.md, "Same-host device-to-device
// pages (CUDA IPC)"): a ticket whose pages are GPU memory (its shm-pull offer names the decode
// worker's GPU; the decode worker asks for it only when the router said this worker states an
// arena) is served from the worker's GPU arena. The engine runs the prompt and stores every
// layer's pages into the arena with their checksums taken on the GPU (RunToDevice); then the
// pages go as references (TransferSender::PrepareDevice, the metrics' path "cuda-ipc"), the
// decode worker copies them device to device, and the commit follows as on every path.
//
// The transfer is prepared before the prompt runs (DevicePages::checksums_pending): it connects
// and its polls between chunks send the heartbeats that renew the decode worker's lease; the
// checksums are given after the last layer's store (Transfer::SetDeviceChecksums). What does not
// overlap yet: the references leave only after the last layer's store (the host path posts each
// layer during the last chunk).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "prefill/prefill_worker.h"
#include "runtime/cuda_ipc_memory.h"
#include "runtime/paged_state.h"
#include "spdlog/spdlog.h"
#include "worker/transfer_peer.h"

namespace pdserve::prefill {
namespace v1 = pdserve::worker::v1;
namespace {

// Per layer, the PageIds (state kind, index among the table's pages of that kind) of the plan's
// pages of that layer in slot order, and those slots: which checksums RunToDevice takes, and
// where each goes.
struct LayerChecksums {
  std::vector<std::vector<runtime::PagedState::PageId>> ids;
  std::vector<std::vector<size_t>> slots;
};

absl::StatusOr<LayerChecksums> PlanChecksums(const serving::StateLayout& layout,
                                             const serving::PageTable& table,
                                             const std::vector<kv::PlannedPage>& plan,
                                             int64_t layers) {
  LayerChecksums out;
  out.ids.resize(static_cast<size_t>(layers));
  out.slots.resize(static_cast<size_t>(layers));
  for (size_t slot = 0; slot < plan.size(); ++slot) {
    const serving::PageHandle& handle = plan[slot].handle;
    std::optional<serving::StateKind> kind;
    for (int k = 0; k < serving::kNumStateKinds; ++k) {
      const auto candidate = static_cast<serving::StateKind>(k);
      if (layout.KindIndex(candidate) == handle.kind) kind = candidate;
    }
    const std::vector<serving::PageHandle>& pages = table.pages[static_cast<size_t>(handle.kind)];
    const auto at = std::find(pages.begin(), pages.end(), handle);
    const uint32_t layer = plan[slot].descriptor.layer;
    if (!kind.has_value() || at == pages.end() || layer >= layers) {
      return absl::InternalError(absl::StrCat("plan slot ", slot, " is not a page of the table"));
    }
    out.ids[layer].push_back({*kind, static_cast<int64_t>(at - pages.begin())});
    out.slots[layer].push_back(slot);
  }
  return out;
}

}  // namespace

absl::Status PrefillWorker::CreateDeviceArena() {
  if (!engine_->stores_device_pages()) {
    spdlog::info("transfer: cuda ipc not offered: the prefill engine ({}) stores no device pages",
                 engine_->Describe());
    return absl::OkStatus();
  }
  const DeviceArenaOptions& options = *options_.device_arena;
  if (!options.allocate || options.tokens < 0) {
    return absl::InvalidArgumentError("device_arena needs allocate and tokens >= 0");
  }
  const int64_t tokens =
      runtime::CudaIpcRequestTokens(options.tokens, model_.config.max_position_embeddings);
  serving::PagePoolOptions pool_options = runtime::DevicePagePoolOptions(*model_.layout, 1, tokens);
  PDSERVE_ASSIGN_OR_RETURN(arena_,
                           options.allocate(serving::PagePool::HostBytesNeeded(pool_options)));
  pool_options.host_block = arena_.memory;
  PDSERVE_ASSIGN_OR_RETURN(arena_pool_, serving::PagePool::Create(std::move(pool_options)));
  PDSERVE_ASSIGN_OR_RETURN(arena_acks_region_,
                           kv::shm::SharedRegion::Create(kv::shm::kPagesPurpose, 4096));
  PDSERVE_ASSIGN_OR_RETURN(arena_acks_, kv::shm::PullSender::Create(*arena_acks_region_));
  spdlog::info(
      "transfer: cuda ipc offered (a {:.1f} MB GPU arena on {} for requests of up to {} "
      "tokens; decode workers on this host that can map it land its pages device to "
      "device)",
      static_cast<double>(arena_.memory.size()) / 1e6, arena_.name.pci_bus_id, tokens);
  return absl::OkStatus();
}

absl::StatusOr<kv::DevicePages> PrefillWorker::DeviceSources(
    serving::RequestId sequence, const std::vector<kv::PlannedPage>& plan) {
  kv::DevicePages sources{.arena = arena_.name, .checksums_pending = true};
  sources.pages.resize(plan.size());
  for (size_t slot = 0; slot < plan.size(); ++slot) {
    PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> page,
                             arena_pool_->Data(sequence, plan[slot].handle));
    kv::DeviceSourcePage& source = sources.pages[slot];
    source.offset = static_cast<uint64_t>(page.data() - arena_.memory.data());
    source.length = plan[slot].descriptor.bytes;
    source.element = plan[slot].descriptor.element;
  }
  return sources;
}

absl::StatusOr<std::vector<serving::SampledToken>> PrefillWorker::PrefillDevicePages(
    Admitted& a, const serving::PageTable& table, const std::vector<kv::PlannedPage>& plan,
    Sending& sending, std::vector<uint64_t>* checksums, Timing* t) {
  const int64_t layers = model_.config.num_hidden_layers;
  PDSERVE_ASSIGN_OR_RETURN(const LayerChecksums checks,
                           PlanChecksums(*model_.layout, table, plan, layers));
  PDSERVE_ASSIGN_OR_RETURN(runtime::SequencePages pages, runtime::MapPages(*arena_pool_, table));
  const runtime::PagedState paged(model_.config, *model_.layout, a.total);
  // Between chunks: the abort / cancellation check and a poll of the prepared transfer, whose
  // heartbeats keep the decode worker's lease while the prompt runs (as on the host path).
  const runtime::PrefillEngine::ChunkDone chunk_done = [&](int64_t tokens) -> absl::Status {
    chunk_tokens_->Observe(static_cast<double>(tokens));
    prefilled_tokens_.fetch_add(tokens);
    return Check(a.id, sending);
  };
  t->prefill_start = absl::Now();
  PDSERVE_ASSIGN_OR_RETURN(runtime::PrefillEngine::DeviceRun run,
                           engine_->RunToDevice(a.prompt, paged, pages, checks.ids, chunk_done));
  PDSERVE_ASSIGN_OR_RETURN(std::vector<serving::SampledToken> first, SampleFirst(a, run.logits));
  t->prefill_end = absl::Now();
  checksums->assign(plan.size(), 0);
  for (size_t l = 0; l < checks.slots.size(); ++l) {
    if (run.checksums.size() != checks.slots.size() ||
        run.checksums[l].size() != checks.slots[l].size()) {
      return absl::InternalError("the engine returned another count of page checksums");
    }
    for (size_t i = 0; i < checks.slots[l].size(); ++i) {
      (*checksums)[checks.slots[l][i]] = run.checksums[l][i];
    }
  }
  return first;
}

absl::StatusOr<v1::PrefillResponse> PrefillWorker::RunDevicePrefill(
    Admitted& a, const grpc::ServerContext& context) {
  if (arena_pool_ == nullptr) {
    failures_->WithLabels({"prefill_error"}).Increment();
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", a.id,
        ": the ticket asks for GPU pages (cuda ipc) and this prefill worker has "
        "no GPU arena (backend cpu, transfer.cuda_ipc off, or an expert-parallel engine): the "
        "router passed a capability this worker does not state"));
  }
  const serving::RequestId sequence = next_sequence_++;
  absl::StatusOr<serving::PageTable> table =
      arena_pool_->Allocate(sequence, model_.layout->Demand(a.total));
  if (!table.ok()) {
    failures_->WithLabels({"prefill_error"}).Increment();
    return absl::FailedPreconditionError(absl::StrCat("request ", a.id, ": prompt + max_tokens of ",
                                                      a.total,
                                                      " tokens do not fit this worker's GPU arena "
                                                      "(transfer.cuda_ipc_arena_tokens): ",
                                                      table.status().message()));
  }
  absl::Cleanup free_table = [this, &table] { arena_pool_->Free(*table).IgnoreError(); };
  absl::StatusOr<std::vector<kv::PlannedPage>> plan = CheckedPlan(a, *table);
  absl::StatusOr<kv::DevicePages> sources =
      plan.ok() ? DeviceSources(sequence, *plan) : absl::StatusOr<kv::DevicePages>(plan.status());
  if (!sources.ok()) {
    return Failed(sources.status(), /*transfer_error=*/false,
                  Aborted(a.id) || context.IsCancelled());
  }
  // Prepared before the prompt runs (its checksums come after it), so the decode worker's lease
  // is renewed meanwhile. Device pages are read by the decode worker, so the sender needs its ack
  // words (arena_acks_); the test faults act on page messages and do not apply.
  kv::TransferSender sender(*transport_, clock_,
                            {.max_in_flight_bytes = kv::InFlightBytesForLanes(transport_->lanes()),
                             .metrics = transfer_metrics_.get(),
                             .path = "cuda-ipc",
                             .shm_pull = arena_acks_.get()});
  absl::StatusOr<std::unique_ptr<kv::Transfer>> transfer =
      sender.PrepareDevice(a.ticket, *std::move(sources));
  if (!transfer.ok()) return PrepareFailed(transfer.status());
  in_flight_->Add(1);
  absl::Cleanup not_in_flight = [this] { in_flight_->Add(-1); };
  // Every failure from here on is one failed transfer (the Transfer fences on destruction), as
  // on the host path: counted by the transfer's error, or "prefill_error" when the prompt failed.
  Sending sending{**transfer, context};
  Timing t;
  std::vector<uint64_t> checksums;
  absl::StatusOr<std::vector<serving::SampledToken>> first =
      PrefillDevicePages(a, *table, *plan, sending, &checksums, &t);
  absl::Status sent = first.status();
  if (sent.ok()) {
    t.first_post = absl::Now();
    sent = (*transfer)->SetDeviceChecksums(checksums);
    if (sent.ok()) sent = (*transfer)->PostAll();
    if (!sent.ok()) sent = sending.Fail(sent);
  }
  if (sent.ok()) sent = Deliver(a, *first, sending);
  if (!sent.ok()) {
    return Failed(sent, sending.transfer_error, Aborted(a.id) || context.IsCancelled());
  }
  t.transfer_end = absl::Now();
  RecordTransfer(a.ticket, t, /*pulled=*/true);
  return Response(a, *first, t);
}

}  // namespace pdserve::prefill
