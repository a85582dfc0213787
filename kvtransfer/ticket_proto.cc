#include "kvtransfer/ticket_proto.h"

#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {

namespace v1 = pdserve::worker::v1;

v1::TransferTicket TicketToProto(const Ticket& ticket, absl::Time now) {
  v1::TransferTicket proto;
  proto.set_ticket_id(ticket.ticket_id);
  proto.set_epoch(ticket.epoch);
  proto.set_request_id(ticket.request_id);
  proto.set_ucx_worker_address(reinterpret_cast<const char*>(ticket.worker_address.data()),
                               ticket.worker_address.size());
  proto.set_receiver_incarnation(ticket.receiver_incarnation);
  for (size_t slot = 0; slot < ticket.pages.size(); ++slot) {
    const PageDescriptor& page = ticket.pages[slot];
    v1::PageDescriptor* out = proto.add_pages();
    out->set_slot(static_cast<uint32_t>(slot));
    out->set_layer(page.layer);
    out->set_page_index(page.page_index);
    out->set_token_begin(page.token_begin);
    out->set_token_end(page.token_end);
    out->set_bytes(page.bytes);
    out->set_element(static_cast<uint32_t>(page.element));
  }
  proto.set_lease_deadline_unix_ms(absl::ToUnixMillis(ticket.lease_deadline));
  proto.set_lease_remaining_ms(absl::ToInt64Milliseconds(ticket.lease_deadline - now));
  proto.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(ticket.heartbeat_interval));
  if (ticket.shm_pull.has_value()) {
    v1::ShmPullOffer* offer = proto.mutable_shm_pull();
    offer->set_boot_id(ticket.shm_pull->boot_id);
    offer->set_pid(ticket.shm_pull->acks.pid);
    offer->set_fd(ticket.shm_pull->acks.fd);
    offer->set_bytes(ticket.shm_pull->acks.bytes);
    offer->set_token(reinterpret_cast<const char*>(ticket.shm_pull->acks.token.data()),
                     ticket.shm_pull->acks.token.size());
    offer->set_ack_index(ticket.shm_pull->ack_index);
    offer->set_device_pci_bus_id(ticket.shm_pull->device_pci_bus_id);
  }
  return proto;
}

absl::StatusOr<Ticket> TicketFromProto(const v1::TransferTicket& proto, absl::Time now) {
  Ticket ticket;
  ticket.ticket_id = proto.ticket_id();
  ticket.epoch = proto.epoch();
  ticket.request_id = proto.request_id();
  const std::string& address = proto.ucx_worker_address();
  const auto* begin = reinterpret_cast<const std::byte*>(address.data());
  ticket.worker_address.assign(begin, begin + address.size());
  ticket.receiver_incarnation = proto.receiver_incarnation();
  for (int i = 0; i < proto.pages_size(); ++i) {
    const v1::PageDescriptor& page = proto.pages(i);
    if (page.slot() != static_cast<uint32_t>(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ticket page ", i, " says slot ", page.slot()));
    }
    if (page.token_end() < page.token_begin()) {
      return absl::InvalidArgumentError(absl::StrCat("ticket page ", i, " has token range [",
                                                     page.token_begin(), ", ", page.token_end(),
                                                     ")"));
    }
    if (!serving::IsElementType(page.element())) {
      return absl::InvalidArgumentError(
          absl::StrCat("ticket page ", i, " has unknown element type ", page.element()));
    }
    ticket.pages.push_back({.layer = page.layer(),
                            .page_index = page.page_index(),
                            .token_begin = page.token_begin(),
                            .token_end = page.token_end(),
                            .bytes = page.bytes(),
                            .element = static_cast<serving::ElementType>(page.element())});
  }
  if (proto.heartbeat_interval_ms() < 0) {
    return absl::InvalidArgumentError("negative heartbeat interval");
  }
  ticket.lease_deadline = proto.has_lease_remaining_ms()
                              ? now + absl::Milliseconds(proto.lease_remaining_ms())
                              : absl::FromUnixMillis(proto.lease_deadline_unix_ms());
  ticket.heartbeat_interval = absl::Milliseconds(proto.heartbeat_interval_ms());
  if (proto.has_shm_pull()) {
    const v1::ShmPullOffer& offer = proto.shm_pull();
    ShmPullOffer made;
    // The error names the field at fault (it named all three, "token of 16 bytes (16
    // expected)" included, for a PCI bus id too long: breaker58).
    if (offer.token().size() != made.acks.token.size()) {
      return absl::InvalidArgumentError(absl::StrCat("ticket's shm_pull offer: token of ",
                                                     offer.token().size(), " bytes (",
                                                     made.acks.token.size(), " expected)"));
    }
    if (offer.boot_id().size() > 64) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ticket's shm_pull offer: boot id of ", offer.boot_id().size(), " bytes (at most 64)"));
    }
    if (offer.device_pci_bus_id().size() > kMaxPciBusIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("ticket's shm_pull offer: PCI bus id of ",
                                                     offer.device_pci_bus_id().size(),
                                                     " bytes (at most ", kMaxPciBusIdBytes, ")"));
    }
    made.device_pci_bus_id = offer.device_pci_bus_id();
    made.boot_id = offer.boot_id();
    made.acks.pid = offer.pid();
    made.acks.fd = offer.fd();
    made.acks.bytes = offer.bytes();
    std::memcpy(made.acks.token.data(), offer.token().data(), made.acks.token.size());
    made.ack_index = offer.ack_index();
    ticket.shm_pull = std::move(made);
  }
  return ticket;
}

v1::TransferCommit CommitToProto(const ControlMessage& commit) {
  v1::TransferCommit proto;
  proto.set_ticket_id(commit.ticket_id);
  proto.set_epoch(commit.epoch);
  proto.set_pages_sent(commit.pages_sent);
  for (uint64_t digest : commit.layer_digests) proto.add_layer_digests(digest);
  proto.set_prompt_tokens(commit.prompt_tokens);
  proto.set_first_token(commit.first_token);
  for (int32_t token : commit.more_first_tokens) proto.add_more_first_tokens(token);
  return proto;
}

v1::IsolationError IsolationErrorToProto(const absl::Status& status) {
  const std::optional<IsolationError> kind = GetIsolationError(status);
  if (!kind.has_value()) return v1::ISOLATION_ERROR_UNSPECIFIED;
  // The enums share their numbers (isolation_error.h documents the 1:1 mapping).
  return static_cast<v1::IsolationError>(static_cast<int>(*kind));
}

}  // namespace pdserve::kv
