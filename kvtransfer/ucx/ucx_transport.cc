#include "kvtransfer/ucx/ucx_transport.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvtransfer/ucx/ucs_status.h"

namespace pdserve::kv {
namespace {

class UcxSendOp final : public SendOp {
 public:
  UcxSendOp(ucp_worker_h worker, std::vector<std::byte> header)
      : worker_(worker), header_(std::move(header)) {}
  ~UcxSendOp() override {
    if (request_ == nullptr) return;
    ucp_request_cancel(worker_, request_);
    while (ucp_request_check_status(request_) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(request_);
  }

  // Takes the result of ucp_am_send_nbx.
  void Start(ucs_status_ptr_t request) {
    if (request == nullptr) {
      result_ = absl::OkStatus();
    } else if (UCS_PTR_IS_ERR(request)) {
      result_ = UcsToStatus(UCS_PTR_STATUS(request), "ucp_am_send_nbx");
    } else {
      request_ = request;
    }
  }

  std::optional<absl::Status> Test() override {
    if (request_ != nullptr) {
      const ucs_status_t status = ucp_request_check_status(request_);
      if (status == UCS_INPROGRESS) return std::nullopt;
      ucp_request_free(request_);
      request_ = nullptr;
      result_ = UcsToStatus(status, "page send");
    }
    return result_;
  }

  void Cancel() override {
    if (request_ != nullptr) ucp_request_cancel(worker_, request_);
  }

  const std::vector<std::byte>& header() const { return header_; }

 private:
  ucp_worker_h worker_;
  std::vector<std::byte> header_;  // UCX reads the AM header until completion.
  ucs_status_ptr_t request_ = nullptr;
  absl::Status result_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create() {
  auto context = UcxContext::Create();
  if (!context.ok()) return context.status();
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) return worker.status();
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(*context), std::move(*worker)));
}

UcxTransport::~UcxTransport() {
  // Endpoints close before the worker and context they belong to.
  peers_.clear();
}

absl::StatusOr<PeerId> UcxTransport::Connect(std::span<const std::byte> worker_address,
                                             uint64_t incarnation) {
  for (auto it = peers_.begin(); it != peers_.end(); ++it) {
    Peer& peer = it->second;
    if (!std::equal(peer.address.begin(), peer.address.end(), worker_address.begin(),
                    worker_address.end())) {
      continue;
    }
    if (peer.status.ok() && peer.incarnation == incarnation) return it->first;
    // A failed connection or a restarted receiver: its endpoint and any keys unpacked for it are
    // stale. Drop it; the address gets a fresh endpoint below.
    std::unique_ptr<UcxEndpoint> stale = std::move(peer.endpoint);
    peers_.erase(it);
    stale.reset();
    break;
  }
  const PeerId id = next_peer_++;
  Peer& peer = peers_[id];
  peer.address.assign(worker_address.begin(), worker_address.end());
  peer.incarnation = incarnation;
  auto on_error = [this, id](ucs_status_t status) {
    auto found = peers_.find(id);
    if (found != peers_.end() && found->second.status.ok()) {
      found->second.status = UcsToStatus(status, absl::StrCat("decode worker (peer ", id, ")"));
    }
  };
  auto endpoint = UcxEndpoint::Create(worker_, worker_address, true, on_error);
  if (!endpoint.ok() && absl::IsUnavailable(endpoint.status())) {
    // Shared memory alone cannot detect a lost peer in UCX 1.13; connect without detection and
    // let the ticket's lease bound the transfer instead (docs/protocol.md, "Failure handling").
    endpoint = UcxEndpoint::Create(worker_, worker_address, false, on_error);
  }
  if (!endpoint.ok()) {
    peers_.erase(id);
    return endpoint.status();
  }
  peer.endpoint = std::move(*endpoint);
  return id;
}

absl::StatusOr<std::unique_ptr<SendOp>> UcxTransport::Send(PeerId peer_id, WireKind kind,
                                                           std::span<const std::byte> header,
                                                           std::span<const std::byte> payload) {
  auto found = peers_.find(peer_id);
  if (found == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer_id));
  Peer& peer = found->second;
  if (!peer.status.ok()) return peer.status;
  auto op = std::make_unique<UcxSendOp>(worker_.get(),
                                        std::vector<std::byte>(header.begin(), header.end()));
  ucp_request_param_t param{};
  op->Start(ucp_am_send_nbx(peer.endpoint->get(), static_cast<unsigned>(kind), op->header().data(),
                            op->header().size(), payload.data(), payload.size(), &param));
  return op;
}

void UcxTransport::Progress() { worker_.Progress(); }

absl::Status UcxTransport::PeerStatus(PeerId peer) const {
  auto found = peers_.find(peer);
  if (found == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
  return found->second.status;
}

void UcxTransport::Disconnect(PeerId peer) {
  auto found = peers_.find(peer);
  if (found == peers_.end()) return;
  std::unique_ptr<UcxEndpoint> closing = std::move(found->second.endpoint);
  closing.reset();
  found->second.status = absl::UnavailableError(absl::StrCat("peer ", peer, " disconnected"));
}

}  // namespace pdserve::kv
