// The transfer ticket and the control messages of the transfer protocol (docs/protocol.md).
//
// A ticket is the decode worker's authorization for one sender to write one request's pages:
// ticket id + epoch, the decode worker's UCX worker address and incarnation, one PageDescriptor
// per destination page (the slot is the index in `pages`), and the lease. The pdserve.worker.v1
// TransferTicket message carries the same fields over gRPC; EncodeTicket is the compact form used
// between processes that do not speak gRPC (tests, tools).
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/shared_memory.h"
#include "kvtransfer/wire_kind.h"
#include "serving/element_type.h"

namespace pdserve::kv {

struct PageDescriptor {
  uint32_t layer = 0;
  uint32_t page_index = 0;
  uint32_t token_begin = 0;  // Token range [token_begin, token_end) of the page's rows.
  uint32_t token_end = 0;
  // Size of the receiver's page, whose values are `element`s. A sender whose page holds another
  // element type sends WireBytes(descriptor, its type) bytes, which the receiver converts.
  uint64_t bytes = 0;
  serving::ElementType element = serving::ElementType::kFloat32;

  bool operator==(const PageDescriptor&) const = default;
};

// The payload size of `page` sent with `sent` elements (the same values, another element size).
// InvalidArgument when `sent` is unknown or the page's bytes are not whole elements.
absl::StatusOr<uint64_t> WireBytes(const PageDescriptor& page, serving::ElementType sent);

// The decode worker's offer to have its pages pulled from the sender's shared memory
// (kvtransfer/shm/pull.h; docs/protocol.md, "Same-host pages by shared memory").
inline constexpr size_t kMaxPciBusIdBytes = 31;

struct ShmPullOffer {
  std::string boot_id;     // The decode worker's host (shm::HostBootId), at most 64 bytes.
  shm::RegionName acks;    // Its ack table.
  uint64_t ack_index = 0;  // The word of the ticket's slot 0; slot s uses ack_index + s.
  // Non-empty: the ticket's pages are GPU memory of the decode worker, on the GPU of this PCI bus
  // id (at most kMaxPciBusIdBytes): only pages in the sender's GPU arena can land (CUDA IPC,
  // shm::PageRef::device), so a sender that cannot reference its pages that way must not start
  // the transfer (TransferSender refuses it, FailedPrecondition).
  std::string device_pci_bus_id;
  bool operator==(const ShmPullOffer&) const = default;
};

struct Ticket {
  uint64_t ticket_id = 0;
  uint64_t epoch = 0;
  uint64_t request_id = 0;
  std::vector<std::byte> worker_address;  // The decode worker's ucp worker address.
  uint64_t receiver_incarnation = 0;      // Changes when the decode worker restarts.
  std::vector<PageDescriptor> pages;      // Index = slot.
  absl::Time lease_deadline = absl::InfinitePast();
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  // Set when the decode worker accepts pulled pages; a sender that cannot pull ignores it.
  std::optional<ShmPullOffer> shm_pull;

  uint64_t total_bytes() const;
  bool operator==(const Ticket&) const = default;
};

// The header of `ticket`'s page `slot` sent with `element` values and payload checksum
// `checksum` (what the sender puts on the wire and the receiver checks against the ticket).
// `slot` must be < ticket.pages.size().
PageHeader SlotHeader(const Ticket& ticket, uint32_t slot, serving::ElementType element,
                      uint64_t checksum);

std::vector<std::byte> EncodeTicket(const Ticket& ticket);
// Errors: InvalidArgument for truncated or malformed bytes.
absl::StatusOr<Ticket> DecodeTicket(std::span<const std::byte> bytes);

// Commit, heartbeat and fence: the non-page messages. Fields not used by a kind are zero.
struct ControlMessage {
  WireKind kind = WireKind::kHeartbeat;
  uint64_t request_id = 0;
  uint64_t ticket_id = 0;
  uint64_t epoch = 0;
  uint32_t pages_sent = 0;              // kCommit: pages the sender posted.
  int32_t prompt_tokens = 0;            // kCommit.
  int32_t first_token = -1;             // kCommit: the token the prefill worker sampled.
  std::vector<uint64_t> layer_digests;  // kCommit: LayerDigest of each layer, index = layer.
  // kCommit of a shared prefill (n > 1 choices, worker.v1 SamplingParams.choice_count): the first
  // tokens of the choices after the first, in order. Encoded after the digests as a count and
  // the ids; empty encodes nothing, so an n = 1 commit is byte-identical to before.
  std::vector<int32_t> more_first_tokens;

  bool operator==(const ControlMessage&) const = default;
};

std::vector<std::byte> EncodeControl(const ControlMessage& message);
// Errors: InvalidArgument for truncated bytes, a bad magic / version, or a page kind.
absl::StatusOr<ControlMessage> DecodeControl(std::span<const std::byte> bytes);

// xxh3-64 over the little-endian payload checksums of one layer's pages in slot order: what the
// commit carries per layer so the receiver cross-checks the set of pages, not only each page.
uint64_t LayerDigest(std::span<const uint64_t> page_checksums_in_slot_order);

}  // namespace pdserve::kv
