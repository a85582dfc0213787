// PageTransport over UCX active messages (ucp_am_send_nbx). Active messages were chosen by
// measurement (docs/protocol.md, "Choice of UCX operation"): over tcp, emulated put moves
// ~0.2 GB/s while AM and tagged messages move ~5 GB/s, and AM lets the receiver check each
// page's header before any byte lands in its memory.
//
// Lanes (docs/protocol.md, "Lanes"): with `lanes` > 1 the transport has one UCX worker and one
// progress thread per lane, and a connection has one endpoint per lane (to the receiver's lane
// of the same index modulo its lane count). Pages go round-robin over the lanes; control
// messages (commit, heartbeat, fence) on lane 0. A connection fails as a whole when any of its
// endpoints fails. One lane runs exactly as before lanes: no thread, Progress() drives it.
//
// Thread-safety: the PageTransport contract (one caller thread at a time, for the transport and
// its ops); lane threads are internal.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kvtransfer/page_transport.h"
#include "kvtransfer/ucx/ucx.h"
#include "kvtransfer/ucx/ucx_lane.h"

namespace pdserve::kv {

class UcxTransport final : public PageTransport {
 public:
  // Creates a UCX context and `lanes` workers (transports from UCX_TLS); from 2 lanes, one
  // thread per lane. post_on_lanes (from 2 lanes): page sends are posted by their lane's thread
  // (UcxLane::Submit), so the caller's thread only queues them and the lanes' cores do UCX's
  // send work in parallel; false: posted on the caller's thread. `protocols`: UCX's protocol
  // implementation (ucx.h; the receiver must use the same). Errors: InvalidArgument for lanes
  // outside 1 .. kMaxTransferLanes; the UCX setup error.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(
      int lanes = 1, bool post_on_lanes = true, UcxProtocols protocols = UcxProtocols::kV1);
  ~UcxTransport() override;

  absl::StatusOr<PeerId> Connect(std::span<const std::byte> worker_address,
                                 uint64_t incarnation) override;
  absl::StatusOr<std::unique_ptr<SendOp>> Send(PeerId peer, WireKind kind,
                                               std::span<const std::byte> header,
                                               std::span<const std::byte> payload) override;
  void Progress() override;
  absl::Status PeerStatus(PeerId peer) const override;
  void Disconnect(PeerId peer) override;
  // Registers `memory` (e.g. each block of the prefill's page pool, serving::PagePool::HostBlocks)
  // once with ucp_mem_map; a later page send whose payload lies inside it passes that handle to
  // UCX (UCP_OP_ATTR_FIELD_MEMH), so UCX does not register the page itself (docs/protocol.md,
  // "Registered page memory"). Under UCX 1.13's v2 protocols UCX ignores the handle for sends.
  // The registration lives until the transport goes (after its workers, so after every send that
  // used it); `memory` must outlive the transport. Call from the transport's one caller thread.
  // Errors: InvalidArgument for empty memory; UcsToStatus of ucp_mem_map.
  absl::Status RegisterMemory(std::span<const std::byte> memory);
  // Registrations made so far.
  size_t registered_regions() const { return registered_.size(); }
  int lanes() const override { return static_cast<int>(lanes_.size()); }
  // The protocols in effect (UCX_PROTO_ENABLE in the environment overrides the request).
  UcxProtocols protocols() const { return context_.protocols(); }

  // Endpoint sets (connections) created so far (a reconnect adds one); for tests of the cache.
  uint64_t endpoints_created() const { return next_peer_ - 1; }
  // Pages handed to each lane so far (index = lane).
  const std::vector<uint64_t>& pages_per_lane() const { return pages_per_lane_; }
  // Closes one lane's endpoint of `peer` at once (force, no flush) and fails the connection as
  // UCX's error handler does when that endpoint dies: its in-flight sends fail, PeerStatus says
  // Unavailable, the next Connect makes fresh endpoints. Tests kill one lane mid-transfer with
  // it. No-op for an unknown peer or lane.
  void CloseLaneEndpoint(PeerId peer, int lane);

 private:
  // A connection's health, written by endpoint error callbacks on lane threads.
  struct PeerHealth {
    mutable absl::Mutex mu;
    absl::Status status ABSL_GUARDED_BY(mu);
  };
  struct Peer {
    std::vector<std::byte> address;
    uint64_t incarnation = 0;
    std::vector<std::unique_ptr<UcxEndpoint>> endpoints;  // Index = lane.
    std::shared_ptr<PeerHealth> health;
  };
  UcxTransport(UcxContext context, std::vector<std::unique_ptr<UcxLane>> lanes, bool post_on_lanes)
      : context_(std::move(context)),
        lanes_(std::move(lanes)),
        pages_per_lane_(lanes_.size(), 0),
        post_on_lanes_(post_on_lanes) {}
  // Closes every endpoint of `peer`, each under its lane's lock.
  void CloseEndpoints(Peer& peer);

  UcxContext context_;
  // After context_ and before lanes_: unmapped after the workers go, before the context.
  UcxRegistrations registered_;
  std::vector<std::unique_ptr<UcxLane>> lanes_;
  std::map<PeerId, Peer> peers_;
  PeerId next_peer_ = 1;
  size_t next_page_lane_ = 0;
  std::vector<uint64_t> pages_per_lane_;
  const bool post_on_lanes_;
};

}  // namespace pdserve::kv
