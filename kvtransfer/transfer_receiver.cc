#include "kvtransfer/transfer_receiver.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvtransfer/ucs_status.h"

namespace pdserve::kv {

struct TransferReceiver::Entry {
  enum class Slot : uint8_t { kEmpty, kLanding, kLanded };
  Ticket ticket;
  std::vector<std::span<std::byte>> destinations;
  std::vector<Slot> slots;
  std::vector<uint64_t> header_checksums;
  size_t landed = 0;
  int landings_in_flight = 0;
  TransferState state = TransferState::kReceiving;
  absl::Status status;
  std::optional<ControlMessage> commit;
  absl::Time commit_at;
  bool fence = false;
  // A verified outcome was read by Outcome(): the owner knows the pages are its own.
  mutable bool outcome_read = false;
};

// user_data of one rendezvous receive: which slot of which ticket it fills.
struct TransferReceiver::Landing {
  TransferReceiver* self;
  uint64_t ticket_id;
  uint32_t slot;
};

TransferReceiver::TransferReceiver(ReceiverOptions options, const Clock& clock,
                                   ReleaseFn on_release, UcxContext context, UcxWorker worker)
    : options_(options),
      clock_(clock),
      on_release_(std::move(on_release)),
      context_(std::move(context)),
      worker_(std::move(worker)),
      address_(worker_.address()) {}

absl::StatusOr<std::unique_ptr<TransferReceiver>> TransferReceiver::Create(ReceiverOptions options,
                                                                           const Clock& clock,
                                                                           ReleaseFn on_release) {
  auto context = UcxContext::Create();
  if (!context.ok()) return context.status();
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) return worker.status();
  std::unique_ptr<TransferReceiver> receiver(new TransferReceiver(
      options, clock, std::move(on_release), std::move(*context), std::move(*worker)));
  absl::Status registered = receiver->RegisterHandlers();
  if (!registered.ok()) return registered;
  return receiver;
}

TransferReceiver::~TransferReceiver() {
  // Rendezvous receives hold Landing records and write into caller memory: let them finish (or
  // fail) before the worker goes away.
  absl::MutexLock lock(&mu_);
  const absl::Time until = absl::Now() + absl::Seconds(2);
  auto in_flight = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, entry] : entries_) {
      if (entry->landings_in_flight > 0) return true;
    }
    return false;
  };
  while (in_flight() && absl::Now() < until) worker_.Progress();
}

absl::Status TransferReceiver::RegisterHandlers() {
  absl::MutexLock lock(&mu_);
  for (WireKind kind :
       {WireKind::kPage, WireKind::kCommit, WireKind::kHeartbeat, WireKind::kFence}) {
    ucp_am_handler_param_t param{};
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = static_cast<unsigned>(kind);
    param.flags = UCP_AM_FLAG_WHOLE_MSG;
    param.cb = kind == WireKind::kPage ? &TransferReceiver::OnPage : &TransferReceiver::OnControl;
    param.arg = this;
    const ucs_status_t status = ucp_worker_set_am_recv_handler(worker_.get(), &param);
    if (status != UCS_OK) return UcsToStatus(status, "ucp_worker_set_am_recv_handler");
  }
  return absl::OkStatus();
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
  entry->destinations = std::move(spec.destinations);
  entry->slots.assign(ticket.pages.size(), Entry::Slot::kEmpty);
  entry->header_checksums.assign(ticket.pages.size(), 0);
  Ticket result = ticket;
  entries_[result.ticket_id] = std::move(entry);
  return result;
}

absl::Status TransferReceiver::RegisterMemory(std::span<std::byte> memory) {
  auto registered = UcxMemory::Register(context_, memory.data(), memory.size());
  if (!registered.ok()) return registered.status();
  absl::MutexLock lock(&mu_);
  registered_.push_back(std::move(*registered));
  return absl::OkStatus();
}

void TransferReceiver::Progress() {
  absl::MutexLock lock(&mu_);
  worker_.Progress();
  Sweep();
}

void TransferReceiver::RunFor(absl::Duration duration, absl::Duration poll_interval) {
  const absl::Time until = absl::Now() + duration;
  while (true) {
    Progress();
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return;
    const absl::Duration wait = std::min(left, poll_interval);
    const int wait_ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(wait)));
    absl::StatusOr<int> fd;
    {
      absl::MutexLock lock(&mu_);
      fd = worker_.Arm();
    }
    // Sleep without the lock: Prepare (a Reserve), Abort and Outcome must not wait for it. A
    // failed arm sleeps the interval; events that arrive meanwhile end the sleep.
    if (fd.ok()) {
      UcxWorker::WaitReadable(*fd, wait_ms);
    } else {
      absl::SleepFor(wait);
    }
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
    entry.state = TransferState::kAborted;
    entry.status = absl::CancelledError(absl::StrCat("ticket ", ticket_id, " aborted"));
    // A commit already in hand (pages still within the missing-page grace) is the sender's word
    // that every page send completed: it has finished writing, which is what the fence waits for.
    if (entry.commit.has_value()) entry.fence = true;
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
  entry.state = TransferState::kAbandoned;
  ++stats_.abandoned;
  entry.status = absl::AbortedError(
      absl::StrCat("the prefill worker abandoned the transfer (ticket ", entry.ticket.ticket_id,
                   ": fenced with ", entry.landed, " of ", entry.ticket.pages.size(),
                   " pages landed and no commit)"));
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

ucs_status_t TransferReceiver::OnPage(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<TransferReceiver*>(arg);
  // Runs inside worker_.Progress(), which holds mu_.
  self->mu_.AssertHeld();
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  return self->HandlePage({static_cast<const std::byte*>(header), header_length}, data, length,
                          rendezvous);
}

ucs_status_t TransferReceiver::OnControl(void* arg, const void* /*header*/,
                                         size_t /*header_length*/, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<TransferReceiver*>(arg);
  self->mu_.AssertHeld();
  // Control messages are tens of bytes and always eager; a rendezvous one is not ours.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  self->HandleControl({static_cast<const std::byte*>(data), length});
  return UCS_OK;
}

void TransferReceiver::OnLanded(void* request, ucs_status_t status, size_t /*length*/,
                                void* user_data) {
  std::unique_ptr<Landing> landing(static_cast<Landing*>(user_data));
  landing->self->mu_.AssertHeld();
  landing->self->FinishLanding(landing->ticket_id, landing->slot, status);
  ucp_request_free(request);
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

ucs_status_t TransferReceiver::HandlePage(std::span<const std::byte> header_bytes, void* data,
                                          size_t length, bool rendezvous) {
  // A rejected rendezvous page never lands and its sender's send completes with this status, so
  // a sender that writes to an aborted or failed ticket learns it at once.
  constexpr ucs_status_t kRejected = UCS_ERR_CANCELED;
  auto decoded = DecodePageHeader(header_bytes);
  if (!decoded.ok()) {
    ++stats_.stray_messages;
    return rendezvous ? kRejected : UCS_OK;
  }
  const PageHeader& header = *decoded;
  Entry* entry = FindForHeader(header);
  if (entry == nullptr || entry->state != TransferState::kReceiving) {
    if (entry != nullptr) ++stats_.stray_messages;
    return rendezvous ? kRejected : UCS_OK;
  }
  const Ticket& ticket = entry->ticket;
  const std::string where = absl::StrCat("ticket ", ticket.ticket_id, " slot ", header.slot);
  absl::Status error;
  if (header.epoch != ticket.epoch) {
    error = MakeIsolationError(IsolationError::kEpoch,
                               absl::StrCat(where, " carries epoch ", header.epoch,
                                            ", the ticket's epoch is ", ticket.epoch));
  } else if (header.slot >= ticket.pages.size()) {
    error = MakeIsolationError(
        IsolationError::kHeader,
        absl::StrCat(where, " is beyond the ticket's ", ticket.pages.size(), " pages"));
  } else if (const PageDescriptor& page = ticket.pages[header.slot];
             page.layer != header.layer || page.page_index != header.page_index ||
             page.token_begin != header.token_begin || page.token_end != header.token_end ||
             page.bytes != length) {
    error = MakeIsolationError(
        IsolationError::kHeader,
        absl::StrCat(where, " names layer ", header.layer, " page ", header.page_index, " tokens [",
                     header.token_begin, ", ", header.token_end, ") with ", length,
                     " bytes; the ticket says layer ", page.layer, " page ", page.page_index,
                     " tokens [", page.token_begin, ", ", page.token_end, ") with ", page.bytes,
                     " bytes"));
  } else if (entry->slots[header.slot] != Entry::Slot::kEmpty) {
    error = MakeIsolationError(IsolationError::kDuplicate,
                               absl::StrCat(where, " arrived more than once"));
  }
  if (!error.ok()) {
    FailEntry(*entry, std::move(error));
    return rendezvous ? kRejected : UCS_OK;
  }
  entry->slots[header.slot] = Entry::Slot::kLanding;
  entry->header_checksums[header.slot] = header.payload_xxh3;
  ++entry->landings_in_flight;
  std::byte* destination = entry->destinations[header.slot].data();
  if (!rendezvous) {
    std::memcpy(destination, data, length);
    FinishLanding(ticket.ticket_id, header.slot, UCS_OK);
    return UCS_OK;
  }
  auto* landing = new Landing{this, ticket.ticket_id, header.slot};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv_am = &TransferReceiver::OnLanded;
  param.user_data = landing;
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(worker_.get(), data, destination, length, &param);
  if (UCS_PTR_IS_ERR(request)) {
    delete landing;
    FinishLanding(ticket.ticket_id, header.slot, UCS_PTR_STATUS(request));
  }
  return UCS_OK;
}

void TransferReceiver::FinishLanding(uint64_t ticket_id, uint32_t slot, ucs_status_t status) {
  auto found = entries_.find(ticket_id);
  if (found == entries_.end()) return;  // Unreachable: entries with landings are never erased.
  Entry& entry = *found->second;
  --entry.landings_in_flight;
  if (status != UCS_OK) {
    // The sender vanished mid-page; the page stays empty and the lease decides.
    entry.slots[slot] = Entry::Slot::kEmpty;
    return;
  }
  entry.slots[slot] = Entry::Slot::kLanded;
  ++entry.landed;
  ++stats_.pages_landed;
  stats_.bytes_landed += entry.destinations[slot].size();
  if (entry.state != TransferState::kReceiving) return;
  const uint64_t actual = PayloadChecksum(entry.destinations[slot]);
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
  TryVerify(entry);
}

void TransferReceiver::HandleControl(std::span<const std::byte> bytes) {
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

void TransferReceiver::FailEntry(Entry& entry, absl::Status status) {
  if (entry.state != TransferState::kReceiving) return;
  entry.state = TransferState::kFailed;
  if (std::optional<IsolationError> kind = GetIsolationError(status); kind.has_value()) {
    ++stats_.isolation_errors[*kind];
  }
  entry.status = std::move(status);
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
  entry.state = TransferState::kVerified;
  entry.status = absl::OkStatus();
}

void TransferReceiver::Sweep() {
  const absl::Time now = clock_.Now();
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& entry = *it->second;
    const Ticket& ticket = entry.ticket;
    if (entry.state == TransferState::kReceiving) {
      if (now > ticket.lease_deadline) {
        FailEntry(entry,
                  MakeIsolationError(
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
    if (release || forget) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace pdserve::kv
