// The prefill side of a transfer: writes one ticket's pages to the decode worker and commits.
//
// Lifecycle (house style, after nixl): Prepare -> Post (per layer, while the engine computes the
// next one, or all at once) -> Commit -> Poll until done -> Release. A Transfer destroyed before it
// is released cancels its sends, waits until none is in flight and then tells the receiver so
// with a fence message (docs/protocol.md, "Abort fence").
//
// Thread-safety: a TransferSender and its Transfers are used by one thread (the one that drives
// the transport).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtransfer/page_transport.h"
#include "kvtransfer/ticket.h"
#include "serving/clock.h"

namespace pdserve::kv {

class Transfer {
 public:
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  // Cancels unless Release() succeeded (see the file comment).
  ~Transfer();

  // Posts every page of `layer` (its state must be final: the checksum is taken now).
  // Errors: FailedPrecondition after Commit or a failure; the transfer's error if it failed.
  absl::Status PostLayer(uint32_t layer);
  // Posts every page not yet posted.
  absl::Status PostAll();
  // Asks for the commit, sent once every page send has completed. Requires all pages posted.
  absl::Status Commit(int32_t prompt_tokens, int32_t first_token);
  // Drives the transport, sends heartbeats, and reports: true once the commit was delivered,
  // false while in flight. Errors (the transfer stops and cancels its sends): Unavailable when the
  // decode worker is lost, DeadlineExceeded when the lease passed, the send's error otherwise.
  absl::StatusOr<bool> Poll();
  // Ends a delivered transfer (no fence needed). Errors: FailedPrecondition if not delivered.
  absl::Status Release();

  const Ticket& ticket() const { return ticket_; }
  size_t pages_posted() const { return pages_posted_; }
  size_t pages_completed() const { return pages_completed_; }

 private:
  friend class TransferSender;
  Transfer(PageTransport& transport, const serving::Clock& clock, Ticket ticket, PeerId peer,
           std::vector<std::span<const std::byte>> pages);
  absl::Status PostSlot(uint32_t slot);
  absl::Status Fail(absl::Status status);
  void SendHeartbeatIfDue();

  PageTransport& transport_;
  const serving::Clock& clock_;
  Ticket ticket_;
  PeerId peer_;
  std::vector<std::span<const std::byte>> pages_;
  std::vector<uint64_t> checksums_;
  std::vector<std::unique_ptr<SendOp>> page_ops_;  // Index = slot; null until posted.
  std::vector<bool> page_done_;
  size_t pages_posted_ = 0;
  size_t pages_completed_ = 0;
  std::unique_ptr<SendOp> commit_op_;
  std::vector<std::byte> commit_bytes_;
  bool commit_requested_ = false;
  std::unique_ptr<SendOp> heartbeat_op_;
  std::vector<std::byte> heartbeat_bytes_;
  absl::Time next_heartbeat_;
  // The lease as the sender can vouch for it: the ticket's deadline, pushed out by the lease's
  // initial length from each heartbeat sent (the receiver renews from arrival, which is later).
  absl::Duration lease_length_;
  absl::Time lease_deadline_;
  absl::Status error_;
  bool delivered_ = false;
  bool released_ = false;
};

class TransferSender {
 public:
  // `transport` and `clock` must outlive the sender and its transfers.
  TransferSender(PageTransport& transport, const serving::Clock& clock)
      : transport_(transport), clock_(clock) {}

  // Connects to the ticket's decode worker and checks the sources against the ticket: one span per
  // slot, each exactly the descriptor's size. The spans must stay valid until the Transfer ends.
  // Errors: InvalidArgument (count or size mismatch), DeadlineExceeded (lease already over),
  // the transport's connect error.
  absl::StatusOr<std::unique_ptr<Transfer>> Prepare(const Ticket& ticket,
                                                    std::vector<std::span<const std::byte>> pages);

 private:
  PageTransport& transport_;
  const serving::Clock& clock_;
};

}  // namespace pdserve::kv
