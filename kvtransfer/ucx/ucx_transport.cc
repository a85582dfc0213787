#include "kvtransfer/ucx/ucx_transport.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "kvtransfer/ucx/lane_address.h"
#include "kvtransfer/ucx/ucs_status.h"

namespace pdserve::kv {
namespace {

// A page or control send. Its outcome is published once through `done_` (release; read with
// acquire), so Test() on a send still in flight takes no lock: a sender polls every send of its
// window on each Poll(), and with lane threads those locks contended with the lanes' progress.
// Everything that decides the outcome (posting, completion callback, cancel, abandon) runs under
// the lane's lock; the completion callback frees the UCX request itself.
class UcxSendOp final : public SendOp, public LaneSend {
 public:
  // `memh`: a registration that holds the payload (UcxRegistrations), or nullptr.
  UcxSendOp(UcxLane& lane, std::vector<std::byte> header, ucp_ep_h ep, unsigned am_id,
            std::span<const std::byte> payload, ucp_mem_h memh)
      : lane_(lane),
        header_(std::move(header)),
        ep_(ep),
        am_id_(am_id),
        payload_(payload),
        memh_(memh) {}
  ~UcxSendOp() override {
    absl::MutexLock lock(&lane_.mu());
    if (queued_.load()) lane_.Withdraw(this);
    if (request_ == nullptr) return;
    ucp_worker_h worker = lane_.worker().get();
    ucp_request_cancel(worker, request_);
    // OnDone (inside this progress, under the lock held here) frees the request.
    while (request_ != nullptr) ucp_worker_progress(worker);
  }

  // Hands the send to the lane's thread (without the lane's lock: UcxLane::Submit).
  void Queue() {
    queued_.store(true);
    lane_.Submit(this);
  }

  // Posts the message (the lane's lock held by the caller: the owner's thread, or the lane's).
  void Post() override {
    queued_.store(false);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxSendOp::OnDone;
    param.user_data = this;
    if (memh_ != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh_;
    }
    if (am_id_ != static_cast<unsigned>(WireKind::kPage)) {
      // References (at most 4 KiB) and control messages go eager whatever UCX_RNDV_THRESH says:
      // the receiver refuses them by rendezvous (docs/protocol.md, "Batched references"), and a
      // threshold under a batch's size failed every pulled transfer (breaker57).
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_AM_SEND_FLAG_EAGER;
    }
    const ucs_status_ptr_t request = ucp_am_send_nbx(ep_, am_id_, header_.data(), header_.size(),
                                                     payload_.data(), payload_.size(), &param);
    if (request == nullptr) {
      Finish(absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(request)) {
      Finish(UcsToStatus(UCS_PTR_STATUS(request), "ucp_am_send_nbx"));
    } else {
      request_ = request;
      lane_.AddBusy(1);  // Until OnDone, which runs inside a later progress of this lane.
      lane_.Wake();      // Its thread may be asleep on the event fd.
    }
  }

  void Abandon(absl::Status status) override {
    queued_.store(false);
    Finish(std::move(status));
  }
  ucp_ep_h endpoint() const override { return ep_; }

  std::optional<absl::Status> Test() override {
    if (!done_.load(std::memory_order_acquire)) return std::nullopt;
    return result_;  // Written before done_, never after.
  }

  void Cancel() override {
    absl::MutexLock lock(&lane_.mu());
    if (queued_.load() && lane_.Withdraw(this)) {
      queued_.store(false);
      Finish(absl::CancelledError("page send cancelled before it was posted"));
      return;
    }
    if (request_ != nullptr) ucp_request_cancel(lane_.worker().get(), request_);
  }

 private:
  // Runs inside a progress of the lane's worker, under its lock.
  static void OnDone(void* request, ucs_status_t status, void* user_data) {
    auto* self = static_cast<UcxSendOp*>(user_data);
    ucp_request_free(request);
    self->request_ = nullptr;
    self->lane_.AddBusy(-1);
    self->Finish(UcsToStatus(status, "page send"));
  }

  // Publishes the outcome (once; under the lane's lock).
  void Finish(absl::Status status) {
    result_ = std::move(status);
    done_.store(true, std::memory_order_release);
  }

  UcxLane& lane_;
  const std::vector<std::byte> header_;  // UCX reads the AM header until completion.
  const ucp_ep_h ep_;
  const unsigned am_id_;
  const std::span<const std::byte> payload_;
  const ucp_mem_h memh_;  // Owned by the transport's registrations, which outlive the op.
  // Waiting in the lane's queue: set before Submit, cleared under lane_.mu() when the lane posts
  // or abandons it or a cancel withdraws it (a send off the queue is posted under that lock).
  std::atomic<bool> queued_{false};
  ucs_status_ptr_t request_ = nullptr;  // Guarded by lane_.mu(): posted, not yet completed.
  absl::Status result_;                 // Final once done_ is set.
  std::atomic<bool> done_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(int lanes, bool post_on_lanes,
                                                                   UcxProtocols protocols) {
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
  std::unique_ptr<UcxTransport> transport(
      new UcxTransport(std::move(*context), std::move(made), post_on_lanes));
  if (lanes > 1) {
    for (auto& lane : transport->lanes_) lane->StartThread();
  }
  return transport;
}

UcxTransport::~UcxTransport() {
  // Endpoints close before the workers and context they belong to.
  for (auto& [id, peer] : peers_) CloseEndpoints(peer);
  peers_.clear();
  for (auto& lane : lanes_) lane->StopThread();
}

void UcxTransport::CloseEndpoints(Peer& peer) {
  for (size_t lane = 0; lane < peer.endpoints.size(); ++lane) {
    absl::MutexLock lock(&lanes_[lane]->mu());
    if (peer.endpoints[lane] != nullptr) {
      lanes_[lane]->AbandonFor(peer.endpoints[lane]->get(),
                               absl::UnavailableError("the endpoint closed before the send"));
    }
    peer.endpoints[lane].reset();
  }
  peer.endpoints.clear();
}

absl::StatusOr<PeerId> UcxTransport::Connect(std::span<const std::byte> worker_address,
                                             uint64_t incarnation) {
  for (auto it = peers_.begin(); it != peers_.end(); ++it) {
    Peer& peer = it->second;
    if (!std::equal(peer.address.begin(), peer.address.end(), worker_address.begin(),
                    worker_address.end())) {
      continue;
    }
    if (PeerStatus(it->first).ok() && peer.incarnation == incarnation) return it->first;
    // A failed connection or a restarted receiver: its endpoints and any keys unpacked for them
    // are stale. Drop them; the address gets fresh endpoints below.
    CloseEndpoints(peer);
    peers_.erase(it);
    break;
  }
  auto receiver_lanes = DecodeLaneAddresses(worker_address);
  if (!receiver_lanes.ok()) return receiver_lanes.status();
  const PeerId id = next_peer_++;
  Peer& peer = peers_[id];
  peer.address.assign(worker_address.begin(), worker_address.end());
  peer.incarnation = incarnation;
  peer.health = std::make_shared<PeerHealth>();
  auto on_error = [health = peer.health, id](ucs_status_t status) {
    absl::MutexLock lock(&health->mu);
    if (health->status.ok()) {
      health->status = UcsToStatus(status, absl::StrCat("decode worker (peer ", id, ")"));
    }
  };
  for (size_t lane = 0; lane < lanes_.size(); ++lane) {
    const std::vector<std::byte>& address = (*receiver_lanes)[lane % receiver_lanes->size()];
    absl::StatusOr<std::unique_ptr<UcxEndpoint>> endpoint;
    {
      absl::MutexLock lock(&lanes_[lane]->mu());
      const UcxWorker& worker = lanes_[lane]->worker();
      endpoint = UcxEndpoint::Create(worker, address, true, on_error);
      if (!endpoint.ok() && absl::IsUnavailable(endpoint.status())) {
        // Shared memory alone cannot detect a lost peer in UCX 1.13; connect without detection
        // and let the ticket's lease bound the transfer instead (docs/protocol.md, "Failure
        // handling").
        endpoint = UcxEndpoint::Create(worker, address, false, on_error);
      }
    }
    if (!endpoint.ok()) {
      CloseEndpoints(peer);
      peers_.erase(id);
      return endpoint.status();
    }
    peer.endpoints.push_back(std::move(*endpoint));
  }
  return id;
}

absl::StatusOr<std::unique_ptr<SendOp>> UcxTransport::Send(PeerId peer_id, WireKind kind,
                                                           std::span<const std::byte> header,
                                                           std::span<const std::byte> payload) {
  auto found = peers_.find(peer_id);
  if (found == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer_id));
  if (absl::Status status = PeerStatus(peer_id); !status.ok()) return status;
  Peer& peer = found->second;
  if (peer.endpoints.empty()) {
    return absl::UnavailableError(absl::StrCat("peer ", peer_id, " disconnected"));
  }
  size_t lane = 0;
  // Page references spread over the lanes like pages: the receiver copies on the lane's thread.
  const bool page = kind == WireKind::kPage || kind == WireKind::kPageRef;
  if (page) {
    lane = next_page_lane_++ % lanes_.size();
    ++pages_per_lane_[lane];
  }
  auto op = std::make_unique<UcxSendOp>(
      *lanes_[lane], std::vector<std::byte>(header.begin(), header.end()),
      peer.endpoints[lane]->get(), static_cast<unsigned>(kind), payload,
      kind == WireKind::kPage ? registered_.Find(payload.data(), payload.size()) : nullptr);
  if (page && post_on_lanes_ && lanes_[lane]->threaded()) {
    op->Queue();
  } else {
    absl::MutexLock lock(&lanes_[lane]->mu());
    op->Post();
  }
  return op;
}

absl::Status UcxTransport::RegisterMemory(std::span<const std::byte> memory) {
  return registered_.Add(context_, memory);
}

void UcxTransport::Progress() {
  for (auto& lane : lanes_) {
    if (lane->threaded()) continue;  // Its thread drives it.
    absl::MutexLock lock(&lane->mu());
    lane->worker().Progress();
  }
}

absl::Status UcxTransport::PeerStatus(PeerId peer) const {
  auto found = peers_.find(peer);
  if (found == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
  absl::MutexLock lock(&found->second.health->mu);
  return found->second.health->status;
}

void UcxTransport::CloseLaneEndpoint(PeerId peer_id, int lane) {
  auto found = peers_.find(peer_id);
  if (found == peers_.end() || lane < 0 ||
      static_cast<size_t>(lane) >= found->second.endpoints.size()) {
    return;
  }
  {
    absl::MutexLock lock(&found->second.health->mu);
    if (found->second.health->status.ok()) {
      found->second.health->status = absl::UnavailableError(
          absl::StrCat("decode worker (peer ", peer_id, "): lane ", lane, " endpoint closed"));
    }
  }
  absl::MutexLock lock(&lanes_[lane]->mu());
  if (found->second.endpoints[lane] != nullptr) {
    lanes_[lane]->AbandonFor(
        found->second.endpoints[lane]->get(),
        absl::UnavailableError(absl::StrCat("lane ", lane, " endpoint closed before the send")));
  }
  found->second.endpoints[lane].reset();
}

void UcxTransport::Disconnect(PeerId peer_id) {
  auto found = peers_.find(peer_id);
  if (found == peers_.end()) return;
  CloseEndpoints(found->second);
  absl::MutexLock lock(&found->second.health->mu);
  if (found->second.health->status.ok()) {
    found->second.health->status =
        absl::UnavailableError(absl::StrCat("peer ", peer_id, " disconnected"));
  }
}

}  // namespace pdserve::kv
