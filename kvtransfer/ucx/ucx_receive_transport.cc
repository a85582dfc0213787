#include "kvtransfer/ucx/ucx_receive_transport.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvtransfer/ucx/lane_address.h"
#include "kvtransfer/ucx/ucs_status.h"

namespace pdserve::kv {

// The AM handlers' argument: the transport and the lane whose worker ran the handler.
struct UcxReceiveTransport::Handler {
  UcxReceiveTransport* transport;
  UcxLane* lane;
  std::atomic<uint64_t> pages{0};
  // Pulled pages of GPU arenas for GPU destinations (SetDeviceLanders); used only with the
  // lane's mutex held (its handlers and its after-progress step).
  std::unique_ptr<shm::DevicePageLander> lander;
};

// user_data of one rendezvous receive: which slot of which ticket it fills, on which lane.
struct UcxReceiveTransport::Landing {
  UcxReceiveTransport* transport;
  UcxLane* lane;
  LandingTarget target;
};

UcxReceiveTransport::UcxReceiveTransport(UcxContext context,
                                         std::vector<std::unique_ptr<UcxLane>> lanes)
    : context_(std::move(context)), lanes_(std::move(lanes)) {
  std::vector<std::vector<std::byte>> addresses;
  for (auto& lane : lanes_) {
    addresses.push_back(lane->address());
    auto handler = std::make_unique<Handler>();
    handler->transport = this;
    handler->lane = lane.get();
    handlers_.push_back(std::move(handler));
  }
  address_ = EncodeLaneAddresses(addresses);
}

absl::StatusOr<std::unique_ptr<UcxReceiveTransport>> UcxReceiveTransport::Create(
    int lanes, UcxProtocols protocols) {
  if (lanes < 1 || lanes > kMaxTransferLanes) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer lanes ", lanes, " outside 1 .. ", kMaxTransferLanes));
  }
  auto context = UcxContext::Create(/*shared_by_threads=*/lanes > 1, protocols);
  if (!context.ok()) return context.status();
  std::vector<std::unique_ptr<UcxLane>> made;
  for (int i = 0; i < lanes; ++i) {
    auto lane = UcxLane::Create(*context);
    if (!lane.ok()) return lane.status();
    made.push_back(std::move(*lane));
  }
  std::unique_ptr<UcxReceiveTransport> transport(
      new UcxReceiveTransport(std::move(*context), std::move(made)));
  absl::Status registered = transport->RegisterHandlers();
  if (!registered.ok()) return registered;
  return transport;
}

UcxReceiveTransport::~UcxReceiveTransport() { Stop(); }

absl::Status UcxReceiveTransport::RegisterHandlers() {
  for (size_t i = 0; i < lanes_.size(); ++i) {
    absl::MutexLock lock(&lanes_[i]->mu());
    for (WireKind kind : {WireKind::kPage, WireKind::kCommit, WireKind::kHeartbeat,
                          WireKind::kFence, WireKind::kPageRef}) {
      ucp_am_handler_param_t param{};
      param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      param.id = static_cast<unsigned>(kind);
      param.flags = UCP_AM_FLAG_WHOLE_MSG;
      param.cb = kind == WireKind::kPage      ? &UcxReceiveTransport::OnPage
                 : kind == WireKind::kPageRef ? &UcxReceiveTransport::OnPageRef
                                              : &UcxReceiveTransport::OnControl;
      param.arg = handlers_[i].get();
      const ucs_status_t status = ucp_worker_set_am_recv_handler(lanes_[i]->worker().get(), &param);
      if (status != UCS_OK) return UcsToStatus(status, "ucp_worker_set_am_recv_handler");
    }
  }
  return absl::OkStatus();
}

void UcxReceiveTransport::SetSinkMutex(absl::Mutex* sink_mutex) {
  sink_mutex_ = sink_mutex;
  if (lanes_.size() < 2 || sink_mutex_ == nullptr) return;
  for (auto& lane : lanes_) lane->StartThread();
}

std::vector<uint64_t> UcxReceiveTransport::pages_per_lane() const {
  std::vector<uint64_t> pages;
  for (const auto& handler : handlers_) pages.push_back(handler->pages.load());
  return pages;
}

void UcxReceiveTransport::Stop() {
  for (auto& lane : lanes_) lane->StopThread();
}

absl::Status UcxReceiveTransport::RegisterMemory(std::span<std::byte> memory) {
  // One registration serves every worker (lane) of the context.
  return registered_.Add(context_, memory);
}

void UcxReceiveTransport::Progress() {
  // Once a second: unmap the page regions of prefill workers that are gone.
  if (const absl::Time now = absl::Now(); now >= next_region_check_) {
    next_region_check_ = now + absl::Seconds(1);
    regions_.DropGone();
  }
  for (size_t i = 0; i < lanes_.size(); ++i) {
    if (lanes_[i]->threaded()) continue;  // Its thread delivers.
    absl::MutexLock lock(&lanes_[i]->mu());
    lanes_[i]->worker().Progress();
    FlushLander(*handlers_[i]);
  }
}

std::function<void(absl::Duration)> UcxReceiveTransport::ArmWait() {
  if (lanes_.size() > 1 && lanes_[0]->threaded()) {
    // The lane threads deliver; the owner only sweeps deadlines between naps.
    return [](absl::Duration timeout) { absl::SleepFor(timeout); };
  }
  absl::StatusOr<int> fd;
  {
    absl::MutexLock lock(&lanes_[0]->mu());
    fd = lanes_[0]->worker().Arm();
  }
  return [fd](absl::Duration timeout) {
    // A failed arm sleeps the timeout; events that arrive meanwhile end the sleep otherwise.
    if (!fd.ok()) {
      absl::SleepFor(timeout);
      return;
    }
    const int timeout_ms =
        static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
    UcxWorker::WaitReadable(*fd, timeout_ms);
  };
}

template <typename Fn>
void UcxReceiveTransport::CallSink(Fn&& fn) {
  // A lane thread is the only caller that does not hold the sink mutex already.
  if (sink_mutex_ != nullptr && lanes_.size() > 1 && lanes_[0]->threaded()) {
    absl::MutexLock lock(sink_mutex_);
    fn();
  } else {
    fn();
  }
}

ucs_status_t UcxReceiveTransport::OnPage(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* handler = static_cast<Handler*>(arg);
  UcxReceiveTransport* self = handler->transport;
  handler->pages.fetch_add(1, std::memory_order_relaxed);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // A refused rendezvous page never lands and its sender's send completes with this status, so
  // a sender that writes to an aborted or failed ticket learns it at once.
  constexpr ucs_status_t kRejected = UCS_ERR_CANCELED;
  std::optional<LandingTarget> target;
  self->CallSink([&] {
    target =
        self->sink_->OnPageHeader({static_cast<const std::byte*>(header), header_length}, length);
  });
  if (!target.has_value()) return rendezvous ? kRejected : UCS_OK;
  if (target->device) {
    // A page message carries host bytes; GPU pages take only pulled pages of a GPU arena.
    self->CallSink([&] {
      self->sink_->OnPageLanded(
          target->ticket_id, target->slot,
          absl::UnavailableError("cuda ipc: a page message cannot land in GPU pages"), 0);
    });
    return rendezvous ? kRejected : UCS_OK;
  }
  if (!rendezvous) {
    // The copy runs outside the sink mutex: lanes copy in parallel. The slot is this page's
    // alone (the sink marked it landing), so no other message touches the destination.
    std::memcpy(target->destination.data(), data, length);
    const uint64_t finished = FinishLanding(*target);  // Checksums in parallel, too.
    self->CallSink([&] {
      self->sink_->OnPageLanded(target->ticket_id, target->slot, absl::OkStatus(), finished);
    });
    return UCS_OK;
  }
  auto* landing = new Landing{self, handler->lane, *target};
  ucp_request_param_t request_param{};
  request_param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  request_param.cb.recv_am = &UcxReceiveTransport::OnLanded;
  request_param.user_data = landing;
  // The destination's registration (the page pool's, RegisterMemory), so UCX does not register
  // the page for this receive.
  if (ucp_mem_h memh =
          self->registered_.Find(target->destination.data(), target->destination.size());
      memh != nullptr) {
    request_param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    request_param.memh = memh;
  }
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(
      handler->lane->worker().get(), data, target->destination.data(), length, &request_param);
  if (UCS_PTR_IS_ERR(request)) {
    delete landing;
    self->CallSink([&] {
      self->sink_->OnPageLanded(target->ticket_id, target->slot,
                                UcsToStatus(UCS_PTR_STATUS(request), "ucp_am_recv_data_nbx"), 0);
    });
    return UCS_OK;
  }
  handler->lane->AddBusy(1);  // Until OnLanded: the lane's thread spins for the data.
  return UCS_OK;
}

ucs_status_t UcxReceiveTransport::OnPageRef(void* arg, const void* /*header*/,
                                            size_t /*header_length*/, void* data, size_t length,
                                            const ucp_am_recv_param_t* param) {
  auto* handler = static_cast<Handler*>(arg);
  UcxReceiveTransport* self = handler->transport;
  // References are at most 4 KiB a message and always eager; a rendezvous one is not ours.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  // The message's pages go to the sink in one call for their headers and one for those that
  // landed here (shared-memory pages), not two per page: the lanes share the sink's mutex.
  shm::LandPageRefs(
      self->regions_, {static_cast<const std::byte*>(data), length},
      [&](std::span<const shm::PageHeaderAt> headers,
          std::vector<std::optional<LandingTarget>>& targets) {
        handler->pages.fetch_add(headers.size(), std::memory_order_relaxed);
        self->CallSink([&] {
          for (size_t i = 0; i < headers.size(); ++i) {
            targets[i] = self->sink_->OnPageHeader(headers[i].header, headers[i].length);
          }
        });
      },
      [&](std::vector<shm::LandedPage>& landed) { self->ReportLanded(landed); },
      handler->lander.get());
  return UCS_OK;
}

void UcxReceiveTransport::ReportLanded(std::vector<shm::LandedPage>& landed) {
  CallSink([&] {
    for (shm::LandedPage& page : landed) {
      sink_->OnPageLanded(page.ticket_id, page.slot, std::move(page.status), page.finished);
    }
  });
}

void UcxReceiveTransport::FlushLander(Handler& handler) {
  if (handler.lander == nullptr || handler.lander->pending() == 0) return;
  std::vector<shm::LandedPage> landed;
  landed.reserve(handler.lander->pending());
  handler.lander->Flush([&](const LandingTarget& target, absl::Status status, uint64_t xxh3) {
    landed.push_back({target.ticket_id, target.slot, std::move(status), xxh3});
  });
  ReportLanded(landed);
}

absl::Status UcxReceiveTransport::SetDeviceLanders(const DeviceLanderFactory& make) {
  for (auto& handler : handlers_) {
    absl::StatusOr<std::unique_ptr<shm::DevicePageLander>> lander = make();
    if (!lander.ok()) return lander.status();
    // Under the lane's mutex: its thread may be running handlers already.
    Handler* h = handler.get();
    absl::MutexLock lock(&h->lane->mu());
    h->lander = std::move(*lander);
    // The lane lands its batch of pulled GPU pages whenever it has delivered what had arrived.
    h->lane->SetAfterProgress([this, h] { FlushLander(*h); });
  }
  return absl::OkStatus();
}

ucs_status_t UcxReceiveTransport::OnControl(void* arg, const void* /*header*/,
                                            size_t /*header_length*/, void* data, size_t length,
                                            const ucp_am_recv_param_t* param) {
  UcxReceiveTransport* self = static_cast<Handler*>(arg)->transport;
  // Control messages are tens of bytes and always eager; a rendezvous one is not ours.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  self->CallSink([&] { self->sink_->OnControl({static_cast<const std::byte*>(data), length}); });
  return UCS_OK;
}

void UcxReceiveTransport::OnLanded(void* request, ucs_status_t status, size_t /*length*/,
                                   void* user_data) {
  std::unique_ptr<Landing> landing(static_cast<Landing*>(user_data));
  landing->lane->AddBusy(-1);
  UcxReceiveTransport* self = landing->transport;
  // Outside the sink mutex when lanes run threads: each lane checksums its own pages.
  const uint64_t finished = status == UCS_OK ? FinishLanding(landing->target) : 0;
  self->CallSink([&] {
    self->sink_->OnPageLanded(landing->target.ticket_id, landing->target.slot,
                              UcsToStatus(status, "rendezvous receive"), finished);
  });
  ucp_request_free(request);
}

absl::StatusOr<std::unique_ptr<TransferReceiver>> CreateUcxReceiver(
    ReceiverOptions options, const Clock& clock, TransferReceiver::ReleaseFn on_release,
    TransferReceiver::OutcomeFn on_outcome, int lanes, UcxProtocols protocols) {
  auto transport = UcxReceiveTransport::Create(lanes, protocols);
  if (!transport.ok()) return transport.status();
  return std::make_unique<TransferReceiver>(std::move(*transport), options, clock,
                                            std::move(on_release), std::move(on_outcome));
}

}  // namespace pdserve::kv
