// Message kinds of the transfer protocol. Each kind is one UCX active-message id, so the receiver
// dispatches on the id and checks it again in the header (docs/protocol.md, "Messages").
#pragma once

#include <cstdint>

namespace pdserve::kv {

enum class WireKind : uint16_t {
  kPage = 1,       // PageHeader + one page payload.
  kCommit = 2,     // TransferCommit: the sender has posted every page of the ticket.
  kHeartbeat = 3,  // Keeps the ticket's lease alive while the sender works.
  kFence = 4,      // The sender has no write in flight for the ticket and will send no more.
  // PageHeader + shm::PageRef: the page lies in the sender's shared memory; the receiver copies it
  // (kvtransfer/shm/pull.h).
  kPageRef = 5,
};

}  // namespace pdserve::kv
