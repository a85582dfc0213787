// The decode worker's side of the CUDA IPC path (docs/protocol.md, "Same-host device-to-device
// pages (CUDA IPC)"): which requests land in device pages, the device page pool, and the slot
// import that reads them. A request goes this way only when all of these hold, else by host
// pages exactly as without the path (the reason logged when it changes):
//   - this worker has the path (DecodeWorkerOptions::device_landing) and an early importer;
//   - the router said at Reserve that the request's prefill worker sends from a GPU arena
//     (ReserveRequest.prefill_cuda_ipc), and this process can map it (DeviceLanding::can_map:
//     the same host, its GPU visible here);
//   - one choice (a shared reservation's forks copy host pages) that fits the pool, with pages
//     and a slot free now.
//   - no lander refused a page of that arena in the last minute (SuspendDeviceSource).
// Once the ticket asks for GPU pages there is no way back: a page the lander cannot map or
// read fails its landing, and the request fails as any failed transfer does (never decodes);
// the arena's next requests go by host pages for a minute.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "decode/decode_worker.h"
#include "kvtransfer/transfer_plan.h"
#include "runtime/cuda_ipc_memory.h"
#include "spdlog/spdlog.h"

namespace pdserve::decode {
namespace v1 = pdserve::worker::v1;
namespace {

constexpr absl::Duration kDeviceSuspension = absl::Seconds(60);

std::string SourceKey(const std::string& boot_id, const std::string& pci_bus_id) {
  return absl::StrCat(boot_id, " / ", pci_bus_id);
}

// The transport's lander, with each refused page reported (SuspendDeviceSource).
class WatchedLander final : public kv::shm::DevicePageLander {
 public:
  using Refused = std::function<void(const std::string& source, const absl::Status& why)>;
  WatchedLander(std::unique_ptr<kv::shm::DevicePageLander> inner, Refused refused)
      : inner_(std::move(inner)), refused_(std::move(refused)) {}
  absl::Status Add(const kv::shm::PageRef& ref, const kv::LandingTarget& target) override {
    absl::Status added = inner_->Add(ref, target);
    if (absl::IsUnavailable(added) && ref.device.has_value()) {
      refused_(SourceKey(ref.device->boot_id, ref.device->pci_bus_id), added);
    }
    return added;
  }
  void Flush(const std::function<void(const kv::LandingTarget&, absl::Status, uint64_t)>& landed)
      override {
    inner_->Flush(landed);
  }
  size_t pending() const override { return inner_->pending(); }

 private:
  const std::unique_ptr<kv::shm::DevicePageLander> inner_;
  const Refused refused_;
};

}  // namespace

void DecodeWorker::SuspendDeviceSource(const std::string& source, const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    absl::Time& until = device_suspended_[source];
    const bool fresh = until < clock_.Now();
    until = clock_.Now() + kDeviceSuspension;
    if (!fresh) return;
  }
  spdlog::warn("transfer: cuda ipc from {} failed ({}): its requests go by host pages for {}",
               source, why.ToString(), absl::FormatDuration(kDeviceSuspension));
}

absl::Status DecodeWorker::CreateDevicePool() {
  DeviceLanding& landing = *options_.device_landing;
  if (!landing.allocate || !landing.landers || !landing.can_map || landing.pci_bus_id.empty() ||
      landing.requests < 1 || landing.request_tokens < 0) {
    return absl::InvalidArgumentError(
        "device_landing needs allocate, landers, can_map, a PCI bus id, requests >= 1 and "
        "request_tokens >= 0");
  }
  const int64_t tokens =
      runtime::CudaIpcRequestTokens(landing.request_tokens, model_.config.max_position_embeddings);
  device_request_tokens_ = tokens;
  serving::PagePoolOptions options =
      runtime::DevicePagePoolOptions(*model_.layout, landing.requests, tokens);
  PDSERVE_ASSIGN_OR_RETURN(device_memory_,
                           landing.allocate(serving::PagePool::HostBytesNeeded(options)));
  options.host_block = device_memory_.bytes;
  PDSERVE_ASSIGN_OR_RETURN(device_page_pool_, serving::PagePool::Create(std::move(options)));
  PDSERVE_RETURN_IF_ERROR(receiver_->SetDeviceLanders(
      [this,
       make = landing.landers]() -> absl::StatusOr<std::unique_ptr<kv::shm::DevicePageLander>> {
        PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<kv::shm::DevicePageLander> lander, make());
        return std::make_unique<WatchedLander>(
            std::move(lander), [this](const std::string& source, const absl::Status& why) {
              SuspendDeviceSource(source, why);
            });
      }));
  spdlog::info(
      "transfer: cuda ipc on (GPU {}: a {:.1f} MB device page pool for {} requests of up to {} "
      "tokens, landed device to device where the prefill worker offers its GPU arena)",
      landing.pci_bus_id, static_cast<double>(device_memory_.bytes.size()) / 1e6, landing.requests,
      tokens);
  return absl::OkStatus();
}

absl::Status DecodeWorker::DevicePagesRefusal(const v1::ReserveRequest& request,
                                              int32_t choice_count, int64_t total_tokens) const {
  if (!request.has_prefill_cuda_ipc()) {
    return absl::FailedPreconditionError("the prefill worker sends no GPU arena pages");
  }
  if (early_importer_ == nullptr) {
    return absl::FailedPreconditionError(
        "this decode worker has no early import (transfer.early_import, one GPU)");
  }
  if (choice_count > 1) {
    return absl::FailedPreconditionError("a shared reservation (n > 1) copies host pages");
  }
  // The prefill worker's arena holds one request of the same key's tokens: a longer one would
  // fail there, so it goes by host pages here.
  if (total_tokens > device_request_tokens_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prompt + max_tokens of ", total_tokens, " tokens exceed the ", device_request_tokens_,
        " of the device page pool and the prefill worker's arena "
        "(transfer.cuda_ipc_arena_tokens)"));
  }
  const v1::CudaIpcSource& source = request.prefill_cuda_ipc();
  {
    absl::MutexLock lock(&mu_);
    auto it = device_suspended_.find(SourceKey(source.boot_id(), source.pci_bus_id()));
    if (it != device_suspended_.end() && it->second > clock_.Now()) {
      return absl::UnavailableError(absl::StrCat(
          "a page of this prefill worker's GPU arena could not be landed here; host pages until ",
          absl::FormatTime(it->second)));
    }
  }
  return options_.device_landing->can_map(source);
}

bool DecodeWorker::BeginDeviceImport(Request& record, const v1::ReserveRequest& request,
                                     int32_t choice_count, kv::ReceiveSpec* spec) {
  if (device_page_pool_ == nullptr) return false;
  const auto prompt = static_cast<int64_t>(record.prompt.size());
  const int64_t total = prompt + record.params.max_tokens;
  auto host_pages = [&](const absl::Status& why, bool expected) {
    if (!expected && device_refusals_.Record({std::string(why.message())})) {
      spdlog::warn(
          "request {} goes by host pages, not cuda ipc: {} (logged again when the "
          "reason changes)",
          record.request_id, std::string(why.message()));
    } else {
      spdlog::debug("request {} goes by host pages: {}", record.request_id,
                    std::string(why.message()));
    }
    return false;
  };
  if (const absl::Status refused = DevicePagesRefusal(request, choice_count, total);
      !refused.ok()) {
    // A prefill worker without an arena is the ordinary case, not worth a warning.
    return host_pages(refused, /*expected=*/!request.has_prefill_cuda_ipc());
  }
  absl::StatusOr<serving::PageTable> table =
      device_page_pool_->Allocate(record.sequence, model_.layout->Demand(total));
  if (!table.ok()) return host_pages(table.status(), /*expected=*/true);  // full now
  std::shared_ptr<const serving::PageLease> lease =
      serving::PageLease::Hold(device_page_pool_.get(), *table);
  absl::StatusOr<std::vector<kv::PlannedPage>> plan =
      kv::PlanTransfer(*model_.layout, model_.layers, *table, prompt, total);
  if (!plan.ok()) return host_pages(plan.status(), /*expected=*/false);
  kv::ReceiveSpec device{.request_id = record.request_id,
                         .epoch = kv::TableEpoch(*table),
                         .device_pci_bus_id = options_.device_landing->pci_bus_id};
  for (const kv::PlannedPage& page : *plan) {
    absl::StatusOr<std::span<std::byte>> bytes =
        device_page_pool_->Data(record.sequence, page.handle);
    if (!bytes.ok()) return host_pages(bytes.status(), /*expected=*/false);
    device.pages.push_back(page.descriptor);
    device.destinations.push_back(*bytes);
  }
  runtime::DevicePageSource source{.hold = lease};
  for (const std::vector<serving::PageHandle>& kind : table->pages) {
    source.pages.emplace_back();
    for (const serving::PageHandle& handle : kind) {
      absl::StatusOr<std::span<std::byte>> bytes = device_page_pool_->Data(record.sequence, handle);
      if (!bytes.ok()) return host_pages(bytes.status(), /*expected=*/false);
      source.pages.back().push_back(bytes->data());
    }
  }
  std::shared_ptr<const serving::PageLease> host;
  {
    absl::MutexLock lock(&mu_);
    host = record.pages;
  }
  if (host == nullptr) return false;
  const absl::Status begun =
      early_importer_->BeginFromDevice(record.sequence, prompt, total, std::move(source), host);
  if (!begun.ok()) return host_pages(begun, /*expected=*/absl::IsResourceExhausted(begun));
  absl::MutexLock lock(&mu_);
  record.early_import = true;
  record.device_pages = std::move(lease);
  *spec = std::move(device);
  return true;
}

}  // namespace pdserve::decode
