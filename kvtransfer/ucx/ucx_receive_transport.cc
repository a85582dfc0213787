#include "kvtransfer/ucx/ucx_receive_transport.h"

#include <cstring>
#include <utility>

#include "kvtransfer/ucx/ucs_status.h"

namespace pdserve::kv {

// user_data of one rendezvous receive: which slot of which ticket it fills.
struct UcxReceiveTransport::Landing {
  PageSink* sink;
  uint64_t ticket_id;
  uint32_t slot;
};

absl::StatusOr<std::unique_ptr<UcxReceiveTransport>> UcxReceiveTransport::Create() {
  auto context = UcxContext::Create();
  if (!context.ok()) return context.status();
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) return worker.status();
  std::unique_ptr<UcxReceiveTransport> transport(
      new UcxReceiveTransport(std::move(*context), std::move(*worker)));
  absl::Status registered = transport->RegisterHandlers();
  if (!registered.ok()) return registered;
  return transport;
}

absl::Status UcxReceiveTransport::RegisterHandlers() {
  for (WireKind kind :
       {WireKind::kPage, WireKind::kCommit, WireKind::kHeartbeat, WireKind::kFence}) {
    ucp_am_handler_param_t param{};
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = static_cast<unsigned>(kind);
    param.flags = UCP_AM_FLAG_WHOLE_MSG;
    param.cb =
        kind == WireKind::kPage ? &UcxReceiveTransport::OnPage : &UcxReceiveTransport::OnControl;
    param.arg = this;
    const ucs_status_t status = ucp_worker_set_am_recv_handler(worker_.get(), &param);
    if (status != UCS_OK) return UcsToStatus(status, "ucp_worker_set_am_recv_handler");
  }
  return absl::OkStatus();
}

absl::Status UcxReceiveTransport::RegisterMemory(std::span<std::byte> memory) {
  auto registered = UcxMemory::Register(context_, memory.data(), memory.size());
  if (!registered.ok()) return registered.status();
  registered_.push_back(std::move(*registered));
  return absl::OkStatus();
}

std::function<void(absl::Duration)> UcxReceiveTransport::ArmWait() {
  absl::StatusOr<int> fd = worker_.Arm();
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

ucs_status_t UcxReceiveTransport::OnPage(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxReceiveTransport*>(arg);
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // A refused rendezvous page never lands and its sender's send completes with this status, so
  // a sender that writes to an aborted or failed ticket learns it at once.
  constexpr ucs_status_t kRejected = UCS_ERR_CANCELED;
  const std::optional<LandingTarget> target =
      self->sink_->OnPageHeader({static_cast<const std::byte*>(header), header_length}, length);
  if (!target.has_value()) return rendezvous ? kRejected : UCS_OK;
  if (!rendezvous) {
    std::memcpy(target->destination.data(), data, length);
    self->sink_->OnPageLanded(target->ticket_id, target->slot, absl::OkStatus());
    return UCS_OK;
  }
  auto* landing = new Landing{self->sink_, target->ticket_id, target->slot};
  ucp_request_param_t request_param{};
  request_param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  request_param.cb.recv_am = &UcxReceiveTransport::OnLanded;
  request_param.user_data = landing;
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(
      self->worker_.get(), data, target->destination.data(), length, &request_param);
  if (UCS_PTR_IS_ERR(request)) {
    delete landing;
    self->sink_->OnPageLanded(target->ticket_id, target->slot,
                              UcsToStatus(UCS_PTR_STATUS(request), "ucp_am_recv_data_nbx"));
  }
  return UCS_OK;
}

ucs_status_t UcxReceiveTransport::OnControl(void* arg, const void* /*header*/,
                                            size_t /*header_length*/, void* data, size_t length,
                                            const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxReceiveTransport*>(arg);
  // Control messages are tens of bytes and always eager; a rendezvous one is not ours.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  self->sink_->OnControl({static_cast<const std::byte*>(data), length});
  return UCS_OK;
}

void UcxReceiveTransport::OnLanded(void* request, ucs_status_t status, size_t /*length*/,
                                   void* user_data) {
  std::unique_ptr<Landing> landing(static_cast<Landing*>(user_data));
  landing->sink->OnPageLanded(landing->ticket_id, landing->slot,
                              UcsToStatus(status, "rendezvous receive"));
  ucp_request_free(request);
}

absl::StatusOr<std::unique_ptr<TransferReceiver>> CreateUcxReceiver(
    ReceiverOptions options, const Clock& clock, TransferReceiver::ReleaseFn on_release,
    TransferReceiver::OutcomeFn on_outcome) {
  auto transport = UcxReceiveTransport::Create();
  if (!transport.ok()) return transport.status();
  return std::make_unique<TransferReceiver>(std::move(*transport), options, clock,
                                            std::move(on_release), std::move(on_outcome));
}

}  // namespace pdserve::kv
