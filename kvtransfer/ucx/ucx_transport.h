// PageTransport over UCX active messages (ucp_am_send_nbx). Active messages were chosen by
// measurement (docs/protocol.md, "Choice of UCX operation"): over tcp, emulated put moves
// ~0.2 GB/s while AM and tagged messages move ~5 GB/s, and AM lets the receiver check each
// page's header before any byte lands in its memory.
//
// Thread-safety: not thread-safe; one thread drives the transport and its ops.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kvtransfer/page_transport.h"
#include "kvtransfer/ucx/ucx.h"

namespace pdserve::kv {

class UcxTransport final : public PageTransport {
 public:
  // Creates a UCX context and worker (transports from UCX_TLS).
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create();
  ~UcxTransport() override;

  absl::StatusOr<PeerId> Connect(std::span<const std::byte> worker_address,
                                 uint64_t incarnation) override;
  absl::StatusOr<std::unique_ptr<SendOp>> Send(PeerId peer, WireKind kind,
                                               std::span<const std::byte> header,
                                               std::span<const std::byte> payload) override;
  void Progress() override;
  absl::Status PeerStatus(PeerId peer) const override;
  void Disconnect(PeerId peer) override;

  UcxWorker& worker() { return worker_; }
  // Endpoints created so far (a reconnect adds one); for tests of the endpoint cache.
  uint64_t endpoints_created() const { return next_peer_ - 1; }

 private:
  struct Peer {
    std::vector<std::byte> address;
    uint64_t incarnation = 0;
    std::unique_ptr<UcxEndpoint> endpoint;
    absl::Status status;
  };
  UcxTransport(UcxContext context, UcxWorker worker)
      : context_(std::move(context)), worker_(std::move(worker)) {}

  UcxContext context_;
  UcxWorker worker_;
  std::map<PeerId, Peer> peers_;
  PeerId next_peer_ = 1;
};

}  // namespace pdserve::kv
