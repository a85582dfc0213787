// The sender's view of the wire, as an interface so tests can wrap it with faults (house style:
// injectable transport). UcxTransport is the real one; FaultInjectingTransport decorates any.
//
// Thread-safety: one thread at a time per transport and for every SendOp it made.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtransfer/wire_kind.h"

namespace pdserve::kv {

// Names one connection to one receiver incarnation; a reconnect yields a new id.
using PeerId = uint64_t;

// One posted message. Destroying a pending op cancels it and waits until UCX no longer touches
// its buffers.
class SendOp {
 public:
  virtual ~SendOp() = default;
  // nullopt while in flight; afterwards the final status (OK, Cancelled, Unavailable, ...).
  virtual std::optional<absl::Status> Test() = 0;
  // Asks the transport to stop the send; Test() reports the outcome.
  virtual void Cancel() = 0;
};

class PageTransport {
 public:
  virtual ~PageTransport() = default;

  // Returns the connection to the receiver at `worker_address`. A cached connection is reused
  // only while its peer is healthy and `incarnation` matches; a failed connection or a restarted
  // receiver gets a fresh endpoint (a transient failure never marks an address dead for good).
  virtual absl::StatusOr<PeerId> Connect(std::span<const std::byte> worker_address,
                                         uint64_t incarnation) = 0;

  // Posts one message of `kind`: `header` (copied; may be empty) followed by `payload`, which
  // must stay valid and unchanged until the op completes or is destroyed.
  // Errors: Unavailable when the peer has failed; NotFound for an unknown peer.
  virtual absl::StatusOr<std::unique_ptr<SendOp>> Send(PeerId peer, WireKind kind,
                                                       std::span<const std::byte> header,
                                                       std::span<const std::byte> payload) = 0;

  // Drives outstanding sends and error detection.
  virtual void Progress() = 0;

  // OK while the peer is usable, else the error that ended it.
  virtual absl::Status PeerStatus(PeerId peer) const = 0;

  // Closes the connection at once; in-flight sends fail.
  virtual void Disconnect(PeerId peer) = 0;

  // How many lanes (UCX workers, endpoints and threads) carry one connection's pages
  // (docs/protocol.md, "Lanes"); the transfer metrics' `lanes` label.
  virtual int lanes() const { return 1; }
};

}  // namespace pdserve::kv
