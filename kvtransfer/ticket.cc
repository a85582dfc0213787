#include "kvtransfer/ticket.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvtransfer/page_header.h"
#include "xxhash.h"

namespace pdserve::kv {
namespace {

constexpr size_t kTicketFixedBytes = 64;
constexpr size_t kDescriptorBytes = 28;
constexpr size_t kControlFixedBytes = 48;
// The shm-pull offer, when present, follows the worker address: magic "SHMP" u32, boot id length
// u32, pid u32, fd u32, region bytes u64, token [16], ack index u64, then the boot id's bytes.
constexpr uint32_t kOfferMagic = 0x504D4853;
constexpr size_t kOfferFixedBytes = 48;
constexpr size_t kMaxBootIdBytes = 64;
constexpr uint32_t kDeviceMagic = 0x56444450;  // "PDDV": the offer's device part.

// Appends little-endian fields to a growing buffer.
class Writer {
 public:
  void Put(uint64_t value, size_t width) {
    const size_t at = out_.size();
    out_.resize(at + width);
    StoreLe(out_, at, value, width);
  }
  void PutBytes(std::span<const std::byte> bytes) {
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
  std::vector<std::byte> Take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

}  // namespace

absl::StatusOr<uint64_t> WireBytes(const PageDescriptor& page, serving::ElementType sent) {
  const auto have = static_cast<uint64_t>(serving::ElementBytes(page.element));
  if (!serving::IsElementType(static_cast<uint64_t>(sent)) || page.bytes % have != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a page of ", page.bytes, " bytes of ", serving::ElementTypeName(page.element),
                     " cannot be sent as element type ", static_cast<uint32_t>(sent)));
  }
  return page.bytes / have * static_cast<uint64_t>(serving::ElementBytes(sent));
}

uint64_t Ticket::total_bytes() const {
  uint64_t total = 0;
  for (const PageDescriptor& page : pages) total += page.bytes;
  return total;
}

PageHeader SlotHeader(const Ticket& ticket, uint32_t slot, serving::ElementType element,
                      uint64_t checksum) {
  const PageDescriptor& page = ticket.pages[slot];
  return {.request_id = ticket.request_id,
          .ticket_id = ticket.ticket_id,
          .epoch = ticket.epoch,
          .slot = slot,
          .layer = page.layer,
          .page_index = page.page_index,
          .token_begin = page.token_begin,
          .token_end = page.token_end,
          .element = element,
          .payload_xxh3 = checksum};
}

std::vector<std::byte> EncodeTicket(const Ticket& ticket) {
  Writer w;
  w.Put(kWireMagic, 4);
  w.Put(kWireVersion, 4);
  w.Put(ticket.ticket_id, 8);
  w.Put(ticket.epoch, 8);
  w.Put(ticket.request_id, 8);
  w.Put(ticket.receiver_incarnation, 8);
  w.Put(static_cast<uint64_t>(absl::ToUnixMicros(ticket.lease_deadline)), 8);
  w.Put(static_cast<uint64_t>(absl::ToInt64Microseconds(ticket.heartbeat_interval)), 8);
  w.Put(ticket.worker_address.size(), 4);
  w.Put(ticket.pages.size(), 4);
  for (const PageDescriptor& page : ticket.pages) {
    w.Put(page.layer, 4);
    w.Put(page.page_index, 4);
    w.Put(page.token_begin, 4);
    w.Put(page.token_end, 4);
    w.Put(page.bytes, 8);
    w.Put(static_cast<uint16_t>(page.element), 4);
  }
  w.PutBytes(ticket.worker_address);
  if (ticket.shm_pull.has_value()) {
    const ShmPullOffer& offer = *ticket.shm_pull;
    w.Put(kOfferMagic, 4);
    w.Put(offer.boot_id.size(), 4);
    w.Put(offer.acks.pid, 4);
    w.Put(offer.acks.fd, 4);
    w.Put(offer.acks.bytes, 8);
    w.PutBytes(std::as_bytes(std::span(offer.acks.token)));
    w.Put(offer.ack_index, 8);
    w.PutBytes(std::as_bytes(std::span(offer.boot_id)));
    if (!offer.device_pci_bus_id.empty()) {
      w.Put(kDeviceMagic, 4);
      w.Put(offer.device_pci_bus_id.size(), 4);
      w.PutBytes(std::as_bytes(std::span(offer.device_pci_bus_id)));
    }
  }
  return w.Take();
}

absl::StatusOr<Ticket> DecodeTicket(std::span<const std::byte> bytes) {
  if (bytes.size() < kTicketFixedBytes || LoadLe(bytes, 0, 4) != kWireMagic ||
      LoadLe(bytes, 4, 4) != kWireVersion) {
    return absl::InvalidArgumentError("not a version-1 transfer ticket");
  }
  Ticket ticket;
  ticket.ticket_id = LoadLe(bytes, 8, 8);
  ticket.epoch = LoadLe(bytes, 16, 8);
  ticket.request_id = LoadLe(bytes, 24, 8);
  ticket.receiver_incarnation = LoadLe(bytes, 32, 8);
  ticket.lease_deadline = absl::FromUnixMicros(static_cast<int64_t>(LoadLe(bytes, 40, 8)));
  ticket.heartbeat_interval = absl::Microseconds(static_cast<int64_t>(LoadLe(bytes, 48, 8)));
  const uint64_t address_bytes = LoadLe(bytes, 56, 4);
  const uint64_t num_pages = LoadLe(bytes, 60, 4);
  const uint64_t expected = kTicketFixedBytes + num_pages * kDescriptorBytes + address_bytes;
  // An offer follows: its fixed part, then its boot id.
  const bool offer = num_pages <= bytes.size() && address_bytes <= bytes.size() &&
                     bytes.size() >= expected + kOfferFixedBytes &&
                     LoadLe(bytes, expected, 4) == kOfferMagic;
  const uint64_t boot_bytes = offer ? LoadLe(bytes, expected + 4, 4) : 0;
  // After the boot id, optionally: the device part's magic, its length and the PCI bus id.
  const uint64_t device_at = expected + kOfferFixedBytes + boot_bytes;
  const bool device = offer && boot_bytes <= kMaxBootIdBytes && bytes.size() >= device_at + 8 &&
                      LoadLe(bytes, device_at, 4) == kDeviceMagic;
  const uint64_t bus_bytes = device ? LoadLe(bytes, device_at + 4, 4) : 0;
  if (offer &&
      (boot_bytes > kMaxBootIdBytes || bus_bytes > kMaxPciBusIdBytes ||
       (device && bus_bytes == 0) || bytes.size() != device_at + (device ? 8 + bus_bytes : 0))) {
    return absl::InvalidArgumentError("transfer ticket's shm-pull offer is malformed");
  }
  if (!offer && bytes.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer ticket is ", bytes.size(), " bytes, its counts say ", expected));
  }
  size_t at = kTicketFixedBytes;
  ticket.pages.resize(num_pages);
  for (PageDescriptor& page : ticket.pages) {
    page.layer = static_cast<uint32_t>(LoadLe(bytes, at, 4));
    page.page_index = static_cast<uint32_t>(LoadLe(bytes, at + 4, 4));
    page.token_begin = static_cast<uint32_t>(LoadLe(bytes, at + 8, 4));
    page.token_end = static_cast<uint32_t>(LoadLe(bytes, at + 12, 4));
    page.bytes = LoadLe(bytes, at + 16, 8);
    const uint64_t element = LoadLe(bytes, at + 24, 4);
    if (!serving::IsElementType(element)) {
      return absl::InvalidArgumentError(
          absl::StrCat("transfer ticket names unknown element type ", element));
    }
    page.element = static_cast<serving::ElementType>(element);
    at += kDescriptorBytes;
  }
  ticket.worker_address.assign(bytes.begin() + at,
                               bytes.begin() + static_cast<ptrdiff_t>(at + address_bytes));
  if (offer) {
    at += address_bytes;
    ShmPullOffer made;
    made.acks.pid = static_cast<uint32_t>(LoadLe(bytes, at + 8, 4));
    made.acks.fd = static_cast<uint32_t>(LoadLe(bytes, at + 12, 4));
    made.acks.bytes = LoadLe(bytes, at + 16, 8);
    std::memcpy(made.acks.token.data(), bytes.data() + at + 24, made.acks.token.size());
    made.ack_index = LoadLe(bytes, at + 40, 8);
    const auto* boot = reinterpret_cast<const char*>(bytes.data() + at + kOfferFixedBytes);
    made.boot_id.assign(boot, boot_bytes);
    if (device) {
      const auto* bus = reinterpret_cast<const char*>(bytes.data() + device_at + 8);
      made.device_pci_bus_id.assign(bus, bus_bytes);
    }
    ticket.shm_pull = std::move(made);
  }
  return ticket;
}

std::vector<std::byte> EncodeControl(const ControlMessage& message) {
  Writer w;
  w.Put(kWireMagic, 4);
  w.Put(kWireVersion, 2);
  w.Put(static_cast<uint16_t>(message.kind), 2);
  w.Put(message.request_id, 8);
  w.Put(message.ticket_id, 8);
  w.Put(message.epoch, 8);
  w.Put(message.pages_sent, 4);
  w.Put(static_cast<uint32_t>(message.prompt_tokens), 4);
  w.Put(static_cast<uint32_t>(message.first_token), 4);
  w.Put(message.layer_digests.size(), 4);
  for (uint64_t digest : message.layer_digests) w.Put(digest, 8);
  if (!message.more_first_tokens.empty()) {
    w.Put(message.more_first_tokens.size(), 4);
    for (int32_t token : message.more_first_tokens) w.Put(static_cast<uint32_t>(token), 4);
  }
  return w.Take();
}

absl::StatusOr<ControlMessage> DecodeControl(std::span<const std::byte> bytes) {
  if (bytes.size() < kControlFixedBytes || LoadLe(bytes, 0, 4) != kWireMagic ||
      LoadLe(bytes, 4, 2) != kWireVersion) {
    return absl::InvalidArgumentError("not a version-1 control message");
  }
  const uint64_t kind = LoadLe(bytes, 6, 2);
  if (kind < static_cast<uint64_t>(WireKind::kCommit) ||
      kind > static_cast<uint64_t>(WireKind::kFence)) {
    return absl::InvalidArgumentError(absl::StrCat("bad control message kind ", kind));
  }
  ControlMessage message;
  message.kind = static_cast<WireKind>(kind);
  message.request_id = LoadLe(bytes, 8, 8);
  message.ticket_id = LoadLe(bytes, 16, 8);
  message.epoch = LoadLe(bytes, 24, 8);
  message.pages_sent = static_cast<uint32_t>(LoadLe(bytes, 32, 4));
  message.prompt_tokens = static_cast<int32_t>(LoadLe(bytes, 36, 4));
  message.first_token = static_cast<int32_t>(LoadLe(bytes, 40, 4));
  const uint64_t num_digests = LoadLe(bytes, 44, 4);
  const uint64_t digests_end = kControlFixedBytes + 8 * num_digests;
  if (num_digests > bytes.size() || bytes.size() < digests_end ||
      (bytes.size() > digests_end && bytes.size() < digests_end + 4)) {
    return absl::InvalidArgumentError("control message size does not match its digest count");
  }
  for (uint64_t i = 0; i < num_digests; ++i) {
    message.layer_digests.push_back(LoadLe(bytes, kControlFixedBytes + 8 * i, 8));
  }
  if (bytes.size() == digests_end) return message;
  // A shared prefill's commit: the other choices' first tokens follow the digests.
  const uint64_t num_tokens = LoadLe(bytes, digests_end, 4);
  if (num_tokens == 0 || num_tokens > bytes.size() ||
      bytes.size() != digests_end + 4 + 4 * num_tokens) {
    return absl::InvalidArgumentError(
        "control message size does not match its digest and first-token counts");
  }
  for (uint64_t i = 0; i < num_tokens; ++i) {
    message.more_first_tokens.push_back(
        static_cast<int32_t>(LoadLe(bytes, digests_end + 4 + 4 * i, 4)));
  }
  return message;
}

uint64_t LayerDigest(std::span<const uint64_t> page_checksums_in_slot_order) {
  std::vector<std::byte> bytes(8 * page_checksums_in_slot_order.size());
  for (size_t i = 0; i < page_checksums_in_slot_order.size(); ++i) {
    StoreLe(bytes, 8 * i, page_checksums_in_slot_order[i], 8);
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

}  // namespace pdserve::kv
