#include "kvtransfer/transfer_receiver.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve::kv {

struct TransferReceiver::Entry {
  enum class Slot : uint8_t { kEmpty, kLanding, kLanded };
  Ticket ticket;
  std::vector<std::span<std::byte>> destinations;
  std::vector<Slot> slots;
  std::vector<uint64_t> header_checksums;
  // Per slot: the element type the page arrived in, and, when it differs from the destination's,
  // the buffer it lands in before it is checksummed and converted (freed after).
  std::vector<serving::ElementType> wire_elements;
  std::vector<std::vector<std::byte>> converting;
  std::vector<uint32_t> layer_pages_left;  // per layer: pages not yet landed and checked
  size_t landed = 0;
  int landings_in_flight = 0;
  TransferState state = TransferState::kReceiving;
  absl::Status status;
  std::optional<ControlMessage> commit;
  absl::Time commit_at;
  absl::Time first_page_at = absl::InfinitePast();  // The first accepted page header.
  bool fence = false;
  // A verified outcome was read by Outcome() or reported to on_outcome: the owner knows the pages
  // are its own.
  mutable bool outcome_read = false;
  // The first of its ack words (ReceiverOptions::acks) when its ticket carries an shm-pull offer.
  std::optional<uint64_t> ack_index;
  // The destinations are GPU memory (ReceiveSpec::device_pci_bus_id).
  bool device = false;
};

TransferReceiver::TransferReceiver(std::unique_ptr<ReceiveTransport> transport,
                                   ReceiverOptions options, const Clock& clock,
                                   ReleaseFn on_release, OutcomeFn on_outcome)
    : options_(options),
      clock_(clock),
      on_release_(std::move(on_release)),
      on_outcome_(std::move(on_outcome)),
      transport_(std::move(transport)),
      address_(transport_->address()) {
  absl::MutexLock lock(&mu_);
  transport_->SetSink(this);
  transport_->SetSinkMutex(&mu_);
}

TransferReceiver::~TransferReceiver() {
  // Receives in flight write into caller memory and call back into this object: let them finish
  // (or fail) before the transport goes away.
  // The lock is dropped between rounds: a transport's lane threads land pages under it.
  const absl::Time until = absl::Now() + absl::Seconds(2);
  auto in_flight = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, entry] : entries_) {
      if (entry->landings_in_flight > 0) return true;
    }
    return false;
  };
  while (absl::Now() < until) {
    absl::MutexLock lock(&mu_);
    if (!in_flight()) break;
    transport_->Progress();
  }
  transport_->Stop();
}

absl::StatusOr<Ticket> TransferReceiver::Expect(ReceiveSpec spec) {
  if (spec.pages.size() != spec.destinations.size()) {
    return absl::InvalidArgumentError(absl::StrCat(spec.pages.size(), " page descriptors but ",
                                                   spec.destinations.size(), " destinations"));
  }
  for (size_t slot = 0; slot < spec.pages.size(); ++slot) {
    if (spec.pages[slot].bytes != spec.destinations[slot].size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("slot ", slot, ": descriptor says ", spec.pages[slot].bytes,
                       " bytes, destination has ", spec.destinations[slot].size()));
    }
  }
  const bool device = !spec.device_pci_bus_id.empty();
  if (spec.device_pci_bus_id.size() > kMaxPciBusIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("PCI bus id of ", spec.device_pci_bus_id.size(), " bytes"));
  }
  if (device && options_.acks == nullptr) {
    return absl::FailedPreconditionError(
        "GPU destination pages need the receiver's ack table (transfer.shm_pull)");
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [id, entry] : entries_) {
    if (entry->ticket.request_id == spec.request_id && entry->state == TransferState::kReceiving) {
      return absl::AlreadyExistsError(
          absl::StrCat("request ", spec.request_id, " already has ticket ", id, " in progress"));
    }
  }
  auto entry = std::make_unique<Entry>();
  Ticket& ticket = entry->ticket;
  ticket.ticket_id = next_ticket_id_++;
  ticket.epoch = spec.epoch;
  ticket.request_id = spec.request_id;
  ticket.worker_address = address_;
  ticket.receiver_incarnation = options_.incarnation;
  ticket.pages = std::move(spec.pages);
  ticket.lease_deadline = clock_.Now() + options_.lease;
  ticket.heartbeat_interval = options_.heartbeat_interval;
  if (options_.acks != nullptr) {
    if (std::optional<uint64_t> index = options_.acks->Reserve(ticket.pages.size());
        index.has_value()) {
      entry->ack_index = index;
      ticket.shm_pull = ShmPullOffer{.boot_id = options_.acks->boot_id(),
                                     .acks = options_.acks->name(),
                                     .ack_index = *index,
                                     .device_pci_bus_id = spec.device_pci_bus_id};
    }
  }
  if (device && !entry->ack_index.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU destination pages: no run of ", ticket.pages.size(), " free ack words"));
  }
  entry->device = device;
  entry->destinations = std::move(spec.destinations);
  entry->slots.assign(ticket.pages.size(), Entry::Slot::kEmpty);
  entry->header_checksums.assign(ticket.pages.size(), 0);
  entry->wire_elements.assign(ticket.pages.size(), serving::ElementType::kFloat32);
  entry->converting.resize(ticket.pages.size());
  for (const PageDescriptor& page : ticket.pages) {
    if (entry->layer_pages_left.size() <= page.layer)
      entry->layer_pages_left.resize(page.layer + 1);
    ++entry->layer_pages_left[page.layer];
  }
  Ticket result = ticket;
  entries_[result.ticket_id] = std::move(entry);
  return result;
}

absl::Status TransferReceiver::SetDeviceLanders(const DeviceLanderFactory& make) {
  // Not under mu_: a lane thread holds its lane's mutex and then mu_ (the sink mutex) around
  // each delivery, and the transport sets each lane's lander under the lane's mutex, so holding
  // mu_ here would take the two in the other order (a deadlock absl's detector reported on the
  // GPU host). The transport's own locking is what makes this safe.
  return transport_->SetDeviceLanders(make);
}

absl::Status TransferReceiver::RegisterMemory(std::span<std::byte> memory) {
  absl::MutexLock lock(&mu_);
  return transport_->RegisterMemory(memory);
}

void TransferReceiver::Progress() {
  absl::MutexLock lock(&mu_);
  transport_->Progress();
  Sweep();
}

void TransferReceiver::RunFor(absl::Duration duration, absl::Duration poll_interval) {
  const absl::Time until = absl::Now() + duration;
  while (true) {
    Progress();
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return;
    std::function<void(absl::Duration)> sleep;
    {
      absl::MutexLock lock(&mu_);
      sleep = transport_->ArmWait();
    }
    // Sleep without the lock: Prepare (a Reserve), Abort and Outcome must not wait for it.
    sleep(std::min(left, poll_interval));
  }
}

absl::StatusOr<TransferOutcome> TransferReceiver::Outcome(uint64_t ticket_id) const {
  absl::MutexLock lock(&mu_);
  auto found = entries_.find(ticket_id);
  if (found == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("ticket ", ticket_id, " is not held"));
  }
  const Entry& entry = *found->second;
  if (entry.state == TransferState::kVerified) entry.outcome_read = true;
  return TransferOutcome{entry.state, entry.status,
                         entry.state == TransferState::kVerified ? entry.commit : std::nullopt};
}

absl::Status TransferReceiver::Abort(uint64_t ticket_id) {
  absl::MutexLock lock(&mu_);
  auto found = entries_.find(ticket_id);
  if (found == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("ticket ", ticket_id, " is not held"));
  }
  Entry& entry = *found->second;
  if (entry.state == TransferState::kVerified) {
    return absl::FailedPreconditionError(
        absl::StrCat("ticket ", ticket_id, " is verified; its pages belong to the request"));
  }
  if (entry.state == TransferState::kReceiving) {
    // A commit already in hand (pages still within the missing-page grace) is the sender's word
    // that every page send completed: it has finished writing, which is what the fence waits for.
    if (entry.commit.has_value()) entry.fence = true;
    Decide(entry, TransferState::kAborted,
           absl::CancelledError(absl::StrCat("ticket ", ticket_id, " aborted")));
  }
  Sweep();
  return absl::OkStatus();
}

void TransferReceiver::ConfirmFence(uint64_t ticket_id) {
  absl::MutexLock lock(&mu_);
  auto found = entries_.find(ticket_id);
  if (found == entries_.end()) return;
  OnFence(*found->second);
  Sweep();
}

void TransferReceiver::OnFence(Entry& entry) {
  entry.fence = true;
  // With a commit the sender claimed every page delivered: the missing-page check decides.
  if (entry.state != TransferState::kReceiving || entry.commit.has_value()) return;
  ++stats_.abandoned;
  Decide(entry, TransferState::kAbandoned,
         absl::AbortedError(absl::StrCat("the prefill worker abandoned the transfer (ticket ",
                                         entry.ticket.ticket_id, ": fenced with ", entry.landed,
                                         " of ", entry.ticket.pages.size(),
                                         " pages landed and no commit)")));
}

ReceiverStats TransferReceiver::stats() const {
  absl::MutexLock lock(&mu_);
  ReceiverStats stats = stats_;
  stats.tickets_held = 0;
  for (const auto& [id, entry] : entries_) {
    if (entry->state == TransferState::kFailed || entry->state == TransferState::kAborted ||
        entry->state == TransferState::kAbandoned) {
      ++stats.tickets_held;
    }
  }
  return stats;
}

TransferReceiver::Entry* TransferReceiver::FindForHeader(const PageHeader& header) {
  auto found = entries_.find(header.ticket_id);
  if (found != entries_.end()) {
    Entry& entry = *found->second;
    if (entry.ticket.request_id != header.request_id) {
      FailEntry(entry, MakeIsolationError(
                           IsolationError::kHeader,
                           absl::StrCat("a page for request ", header.request_id, " names ticket ",
                                        header.ticket_id, ", which belongs to request ",
                                        entry.ticket.request_id)));
      return nullptr;
    }
    return &entry;
  }
  // A ticket this receiver issued and has since released: a late page from an aborted or
  // finished transfer. It is refused like any stray page; it must not fail the request's retry.
  if (header.ticket_id < next_ticket_id_) {
    ++stats_.stray_messages;
    return nullptr;
  }
  for (auto& [id, entry] : entries_) {
    if (entry->ticket.request_id == header.request_id &&
        entry->state == TransferState::kReceiving) {
      FailEntry(*entry, MakeIsolationError(IsolationError::kHeader,
                                           absl::StrCat("request ", header.request_id,
                                                        " got a page naming ticket ",
                                                        header.ticket_id, ", its ticket is ", id)));
      return nullptr;
    }
  }
  ++stats_.stray_messages;
  return nullptr;
}

absl::Status TransferReceiver::CheckPage(const Entry& entry, const PageHeader& header,
                                         size_t length) const {
  const Ticket& ticket = entry.ticket;
  // Formatted only for a refusal: this runs for every page, under the receiver's mutex.
  auto where = [&] { return absl::StrCat("ticket ", ticket.ticket_id, " slot ", header.slot); };
  if (header.epoch != ticket.epoch) {
    return MakeIsolationError(IsolationError::kEpoch,
                              absl::StrCat(where(), " carries epoch ", header.epoch,
                                           ", the ticket's epoch is ", ticket.epoch));
  }
  if (header.slot >= ticket.pages.size()) {
    return MakeIsolationError(
        IsolationError::kHeader,
        absl::StrCat(where(), " is beyond the ticket's ", ticket.pages.size(), " pages"));
  }
  // The payload holds the sender's element type (the header's); its size is the slot's page in
  // that type. An element type the page cannot be converted from counts as a size mismatch.
  const PageDescriptor& page = ticket.pages[header.slot];
  const absl::StatusOr<uint64_t> wire = WireBytes(page, header.element);
  if (page.layer != header.layer || page.page_index != header.page_index ||
      page.token_begin != header.token_begin || page.token_end != header.token_end || !wire.ok() ||
      *wire != length) {
    return MakeIsolationError(
        IsolationError::kHeader,
        absl::StrCat(where(), " names layer ", header.layer, " page ", header.page_index,
                     " tokens [", header.token_begin, ", ", header.token_end, ") with ", length,
                     " bytes of ", serving::ElementTypeName(header.element),
                     "; the ticket says layer ", page.layer, " page ", page.page_index, " tokens [",
                     page.token_begin, ", ", page.token_end, ") with ",
                     wire.ok() ? *wire : page.bytes, " bytes of ",
                     serving::ElementTypeName(header.element), " (", page.bytes, " of ",
                     serving::ElementTypeName(page.element), ")"));
  }
  if (entry.slots[header.slot] != Entry::Slot::kEmpty) {
    return MakeIsolationError(IsolationError::kDuplicate,
                              absl::StrCat(where(), " arrived more than once"));
  }
  return absl::OkStatus();
}

std::optional<LandingTarget> TransferReceiver::OnPageHeader(std::span<const std::byte> header_bytes,
                                                            size_t length) {
  mu_.AssertHeld();  // Runs inside transport_->Progress().
  auto decoded = DecodePageHeader(header_bytes);
  if (!decoded.ok()) {
    ++stats_.stray_messages;
    return std::nullopt;
  }
  const PageHeader& header = *decoded;
  Entry* entry = FindForHeader(header);
  if (entry == nullptr || entry->state != TransferState::kReceiving) {
    if (entry != nullptr) {
      ++stats_.stray_messages;
      Ack(*entry, header.slot, shm::AckState::kRefused);
    }
    return std::nullopt;
  }
  if (absl::Status error = CheckPage(*entry, header, length); !error.ok()) {
    // A duplicate's slot keeps the word of its first landing.
    const bool duplicate = GetIsolationError(error) == IsolationError::kDuplicate;
    FailEntry(*entry, std::move(error));
    if (!duplicate) Ack(*entry, header.slot, shm::AckState::kRefused);
    return std::nullopt;
  }
  if (entry->device && header.element != entry->ticket.pages[header.slot].element) {
    // GPU pages take a page in its descriptor's type only: a conversion would have to run there.
    FailEntry(*entry,
              MakeIsolationError(
                  IsolationError::kHeader,
                  absl::StrCat("ticket ", entry->ticket.ticket_id, " slot ", header.slot,
                               ": a page in element type ", static_cast<int>(header.element),
                               " for GPU pages of type ",
                               static_cast<int>(entry->ticket.pages[header.slot].element))));
    Ack(*entry, header.slot, shm::AckState::kRefused);
    return std::nullopt;
  }
  entry->slots[header.slot] = Entry::Slot::kLanding;
  entry->header_checksums[header.slot] = header.payload_xxh3;
  if (entry->first_page_at == absl::InfinitePast()) entry->first_page_at = clock_.Now();
  entry->wire_elements[header.slot] = header.element;
  ++entry->landings_in_flight;
  const std::span<std::byte> destination = entry->destinations[header.slot];
  // GPU pages: the lander copies and checksums on the GPU; its XXH3 comes back as `finished`.
  if (entry->device)
    return LandingTarget{destination, entry->ticket.ticket_id, header.slot, {}, true};
  const serving::ElementType element = entry->ticket.pages[header.slot].element;
  std::span<std::byte> target = destination;
  if (header.element != element) {
    std::vector<std::byte>& buffer = entry->converting[header.slot];
    buffer.resize(length);
    target = buffer;
  }
  // Runs on the landing thread, outside mu_ when lanes deliver on threads: it reads only the
  // landed bytes and writes only this slot's destination (both the slot's alone until
  // OnPageLanded), so it captures them by value and never touches the entry.
  auto finish = [target, destination, wire = header.element, element,
                 expected = header.payload_xxh3]() -> uint64_t {
    const uint64_t actual = PayloadChecksum(target);
    // A page in another element type reaches its destination only converted, and only once its
    // checksum (over the bytes sent) matched.
    if (wire != element && actual == expected) {
      serving::ConvertElements(target, wire, destination, element);
    }
    return actual;
  };
  return LandingTarget{target, entry->ticket.ticket_id, header.slot, std::move(finish)};
}

void TransferReceiver::OnPageLanded(uint64_t ticket_id, uint32_t slot, absl::Status status,
                                    uint64_t finished) {
  mu_.AssertHeld();
  auto found = entries_.find(ticket_id);
  if (found == entries_.end()) return;  // Unreachable: entries with landings are never erased.
  Entry& entry = *found->second;
  --entry.landings_in_flight;
  // The landing's finish (OnPageHeader) already checksummed the bytes and converted a page that
  // arrived in another element type; its conversion buffer is no longer needed.
  entry.converting[slot] = {};
  // The landing is over (no byte of the sender's is read any more): a puller may reuse its page.
  Ack(entry, slot, status.ok() ? shm::AckState::kLanded : shm::AckState::kFailed);
  if (!status.ok()) {
    // The sender vanished mid-page (or, pulled, its region could not be read); the page stays
    // empty and the lease decides.
    entry.slots[slot] = Entry::Slot::kEmpty;
    return;
  }
  entry.slots[slot] = Entry::Slot::kLanded;
  ++entry.landed;
  ++stats_.pages_landed;
  const absl::StatusOr<uint64_t> wire_bytes =
      WireBytes(entry.ticket.pages[slot], entry.wire_elements[slot]);
  stats_.bytes_landed += wire_bytes.ok() ? *wire_bytes : entry.destinations[slot].size();
  if (entry.state != TransferState::kReceiving) return;
  const uint64_t actual = finished;
  if (actual != entry.header_checksums[slot]) {
    const PageDescriptor& page = entry.ticket.pages[slot];
    FailEntry(entry,
              MakeIsolationError(
                  IsolationError::kChecksum,
                  absl::StrCat("ticket ", ticket_id, " slot ", slot, " (layer ", page.layer,
                               " page ", page.page_index, "): payload xxh3 ", absl::Hex(actual),
                               ", header says ", absl::Hex(entry.header_checksums[slot]))));
    return;
  }
  const uint32_t layer = entry.ticket.pages[slot].layer;
  if (--entry.layer_pages_left[layer] == 0 && options_.on_layer) {
    options_.on_layer(ticket_id, entry.ticket.request_id, layer);
  }
  TryVerify(entry);
}

void TransferReceiver::OnControl(std::span<const std::byte> bytes) {
  mu_.AssertHeld();
  auto decoded = DecodeControl(bytes);
  if (!decoded.ok()) {
    ++stats_.stray_messages;
    return;
  }
  ControlMessage& message = *decoded;
  auto found = entries_.find(message.ticket_id);
  if (found == entries_.end() || found->second->ticket.request_id != message.request_id) {
    ++stats_.stray_messages;
    return;
  }
  Entry& entry = *found->second;
  if (message.kind == WireKind::kFence) {
    OnFence(entry);
    Sweep();
    return;
  }
  if (entry.state == TransferState::kAborted && message.kind == WireKind::kCommit &&
      message.epoch == entry.ticket.epoch) {
    // The sender commits only after every page send of the ticket completed, and sends nothing
    // for it afterwards (a committed transfer is released, not fenced): the commit is its word
    // that no write is in flight. Pages it sent after the abort were refused, never landed.
    entry.fence = true;
    Sweep();
    return;
  }
  if (entry.state != TransferState::kReceiving) return;
  HandleCommitOrHeartbeat(entry, std::move(message));
}

void TransferReceiver::HandleCommitOrHeartbeat(Entry& entry, ControlMessage message) {
  if (message.epoch != entry.ticket.epoch) {
    FailEntry(entry,
              MakeIsolationError(
                  IsolationError::kEpoch,
                  absl::StrCat("ticket ", message.ticket_id, " control message carries epoch ",
                               message.epoch, ", the ticket's epoch is ", entry.ticket.epoch)));
    return;
  }
  if (message.kind == WireKind::kHeartbeat) {
    entry.ticket.lease_deadline =
        std::max(entry.ticket.lease_deadline, clock_.Now() + options_.lease);
    return;
  }
  entry.commit = std::move(message);
  entry.commit_at = clock_.Now();
  TryVerify(entry);
}

void TransferReceiver::Decide(Entry& entry, TransferState state, absl::Status status) {
  entry.state = state;
  // A verified ticket's sender committed after reading every page's ack word: the words are
  // free now. Other outcomes keep them until the ticket is released (the sender may still wait).
  if (state == TransferState::kVerified && entry.ack_index.has_value() &&
      options_.acks != nullptr) {
    options_.acks->Free(*entry.ack_index, entry.ticket.pages.size());
    entry.ack_index.reset();
  }
  entry.status = std::move(status);
  RecordMetrics(entry);
  if (!on_outcome_) return;
  const bool verified = state == TransferState::kVerified;
  if (verified) entry.outcome_read = true;
  on_outcome_(entry.ticket.ticket_id, entry.ticket.request_id,
              TransferOutcome{state, entry.status, verified ? entry.commit : std::nullopt});
}

void TransferReceiver::RecordMetrics(const Entry& entry) {
  TransferMetrics* metrics = options_.metrics;
  if (metrics == nullptr) return;
  switch (entry.state) {
    case TransferState::kVerified:
      metrics->RecordTransfer(entry.device ? "cuda-ipc" : options_.metrics_path,
                              transport_->lanes(), entry.ticket.total_bytes(),
                              entry.first_page_at == absl::InfinitePast()
                                  ? absl::ZeroDuration()
                                  : clock_.Now() - entry.first_page_at);
      return;
    case TransferState::kFailed: {
      const std::optional<IsolationError> kind = GetIsolationError(entry.status);
      if (!kind.has_value()) return;
      metrics->RecordFailure(*kind == IsolationError::kLease ? "timeout"
                                                             : IsolationErrorName(*kind));
      return;
    }
    case TransferState::kAborted:
      metrics->RecordFailure("abort");
      return;
    case TransferState::kAbandoned:
      metrics->RecordFailure("abandoned");
      return;
    case TransferState::kReceiving:
      return;
  }
}

void TransferReceiver::FailEntry(Entry& entry, absl::Status status) {
  if (entry.state != TransferState::kReceiving) return;
  if (std::optional<IsolationError> kind = GetIsolationError(status); kind.has_value()) {
    ++stats_.isolation_errors[*kind];
  }
  Decide(entry, TransferState::kFailed, std::move(status));
}

void TransferReceiver::TryVerify(Entry& entry) {
  if (entry.state != TransferState::kReceiving || !entry.commit.has_value()) return;
  const Ticket& ticket = entry.ticket;
  const ControlMessage& commit = *entry.commit;
  if (commit.pages_sent != ticket.pages.size()) {
    FailEntry(entry, MakeIsolationError(
                         IsolationError::kMissing,
                         absl::StrCat("ticket ", ticket.ticket_id, " commit says ",
                                      commit.pages_sent, " pages sent of ", ticket.pages.size())));
    return;
  }
  if (entry.landed != ticket.pages.size()) return;  // Sweep() applies the missing-page grace.
  std::vector<std::vector<uint64_t>> per_layer;
  for (size_t slot = 0; slot < ticket.pages.size(); ++slot) {
    const uint32_t layer = ticket.pages[slot].layer;
    if (per_layer.size() <= layer) per_layer.resize(layer + 1);
    per_layer[layer].push_back(entry.header_checksums[slot]);
  }
  bool digests_match = per_layer.size() == commit.layer_digests.size();
  for (size_t layer = 0; digests_match && layer < per_layer.size(); ++layer) {
    digests_match = LayerDigest(per_layer[layer]) == commit.layer_digests[layer];
  }
  if (!digests_match) {
    FailEntry(entry, MakeIsolationError(
                         IsolationError::kChecksum,
                         absl::StrCat("ticket ", ticket.ticket_id,
                                      ": layer digests in the commit differ from the pages")));
    return;
  }
  Decide(entry, TransferState::kVerified, absl::OkStatus());
}

void TransferReceiver::CheckDeadlines(Entry& entry, absl::Time now) {
  const Ticket& ticket = entry.ticket;
  if (now > ticket.lease_deadline) {
    FailEntry(entry, MakeIsolationError(
                         IsolationError::kLease,
                         absl::StrCat("ticket ", ticket.ticket_id, " lease expired with ",
                                      entry.landed, " of ", ticket.pages.size(), " pages landed")));
  } else if (entry.commit.has_value() && now > entry.commit_at + options_.missing_grace) {
    std::vector<size_t> missing;
    for (size_t slot = 0; slot < entry.slots.size(); ++slot) {
      if (entry.slots[slot] != Entry::Slot::kLanded) missing.push_back(slot);
    }
    FailEntry(entry, MakeIsolationError(
                         IsolationError::kMissing,
                         absl::StrCat("ticket ", ticket.ticket_id, " committed without slots ",
                                      absl::StrJoin(missing, ","))));
  }
}

void TransferReceiver::Ack(const Entry& entry, uint32_t slot, shm::AckState state) {
  if (!entry.ack_index.has_value() || options_.acks == nullptr ||
      slot >= entry.ticket.pages.size()) {
    return;
  }
  options_.acks->Write(*entry.ack_index + slot, shm::AckWord(entry.ticket.ticket_id, state));
}

void TransferReceiver::PauseGraceOverStall(absl::Time now) {
  if (options_.run_clock == nullptr) return;
  const absl::Time ran = options_.run_clock->Now();
  const absl::Duration gap = ran - last_sweep_run_;
  if (last_sweep_run_ != absl::InfinitePast() && gap > options_.missing_grace) {
    for (auto& [id, entry] : entries_) {
      // A commit that came during the gap came on a lane that ran: its grace runs as usual.
      if (entry->state == TransferState::kReceiving && entry->commit.has_value() &&
          entry->commit_at <= last_sweep_at_) {
        entry->commit_at += gap;
      }
    }
  }
  last_sweep_run_ = ran;
  last_sweep_at_ = now;
}

void TransferReceiver::Sweep() {
  const absl::Time now = clock_.Now();
  PauseGraceOverStall(now);
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& entry = *it->second;
    const Ticket& ticket = entry.ticket;
    if (entry.state == TransferState::kReceiving) CheckDeadlines(entry, now);
    bool release = false;
    bool forget = false;
    if (entry.landings_in_flight == 0) {
      switch (entry.state) {
        case TransferState::kFailed:
          release = now >= ticket.lease_deadline;
          break;
        case TransferState::kAborted:
          release = entry.fence || now >= ticket.lease_deadline;
          break;
        case TransferState::kAbandoned:
          release = true;
          break;
        case TransferState::kVerified:
          // The pages are the request's; keep the outcome readable until the lease would end,
          // and until the owner read it: a receiver that stalled past the lease (a stopped or
          // starved process) can verify and reach the deadline in one sweep, and an outcome
          // dropped unread would leave the owner with neither the request nor its pages. An
          // owner that never reads loses it one more lease later.
          forget = now >= ticket.lease_deadline &&
                   (entry.outcome_read || now >= ticket.lease_deadline + options_.lease);
          break;
        case TransferState::kReceiving:
          break;
      }
    }
    if (release) on_release_(ticket.ticket_id, ticket.request_id, entry.status);
    if ((release || forget) && entry.ack_index.has_value() && options_.acks != nullptr) {
      options_.acks->Free(*entry.ack_index, ticket.pages.size());
    }
    if (release || forget) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace pdserve::kv
