#include "kvtransfer/transfer_sender.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kvtransfer/page_header.h"

namespace pdserve::kv {
namespace {

// Upper bound on how long a cancelled transfer waits for UCX to give its sends back before it
// leaves the rest to the lease (real time: the injected clock may stand still in tests).
constexpr absl::Duration kCancelWait = absl::Seconds(2);

// Progresses `transport` until `op` completes or the real time `until` passes.
bool WaitOpUntil(PageTransport& transport, SendOp& op, absl::Time until) {
  while (!op.Test().has_value()) {
    if (absl::Now() > until) return false;
    transport.Progress();
  }
  return true;
}

bool WaitOp(PageTransport& transport, SendOp& op, absl::Duration limit) {
  return WaitOpUntil(transport, op, absl::Now() + limit);
}

// A pulled page's send (kvtransfer/shm/pull.h): done when the decode worker's ack word names the
// ticket (it has finished reading the page, or refused it unread), when the kPageRef message
// could not be sent, when the decode worker is gone, or (DeadlineExceeded) when no ack came by
// `ack_deadline`: a decode worker that is stopped or whose lane is stuck still takes heartbeats
// at the transport, which would otherwise renew the lease without end. Cancel cannot stop a copy
// the decode worker has begun, so it only cancels the message; Test still waits for one of these.
// A "failed" ack (the decode worker could not map this worker's region or the range) sets
// unreadable(): the decode worker left the slot empty, so the page may go again as a message
// (a page of a GPU arena cannot: its transfer fails).
// One kPageRef message (the references of up to kMaxRefsPerMessage pages) and its send, shared
// by those pages' PullOps.
struct RefMessage {
  std::vector<std::byte> bytes;
  std::unique_ptr<SendOp> op;
  bool cancelled = false;
  std::optional<absl::Status> sent;  // The op's result, once it has one.
};

class PullOp final : public SendOp {
 public:
  PullOp(std::shared_ptr<RefMessage> message, const std::atomic<uint64_t>* word, uint64_t ticket_id,
         PageTransport& transport, PeerId peer, shm::PullSender* sender,
         const shm::RegionName& acks, const Clock& clock, absl::Duration ack_wait,
         absl::Time ack_deadline, bool device)
      : device_(device),
        message_(std::move(message)),
        word_(word),
        ticket_id_(ticket_id),
        transport_(transport),
        peer_(peer),
        sender_(sender),
        acks_(acks),
        clock_(clock),
        ack_wait_(ack_wait),
        ack_deadline_(ack_deadline) {}

  std::optional<absl::Status> Test() override { return TestAt(clock_.Now(), false); }
  // Test with what the caller checked this round: the time `now`, and (`peer_checked`) that the
  // decode worker's endpoint is fine. Transfer::Poll tests every pulled page in flight each round:
  // one clock read and one endpoint check a round, not one per page.
  std::optional<absl::Status> TestAt(absl::Time now, bool peer_checked) {
    const uint64_t word = word_->load(std::memory_order_acquire);
    if ((word >> 2) == ticket_id_) {
      switch (static_cast<shm::AckState>(word & 3)) {
        case shm::AckState::kLanded:
          return absl::OkStatus();
        case shm::AckState::kRefused:
          return absl::CancelledError("the decode worker refused the page");
        default: {
          absl::Status failed = absl::UnavailableError(
              device_ ? "the decode worker could not read the page from this worker's GPU arena "
                        "(CUDA IPC)"
                      : "the decode worker could not read the page from this worker's shared "
                        "memory");
          // Later tickets to it go by active messages. Not for GPU-arena pages: the decode
          // worker decides whether it asks for them (it sends an arena it could not map by host
          // pages for a while, decode/device_pages.cc); refusing its tickets here would fail
          // every request it still asks them for after one batch that failed.
          if (sender_ != nullptr && !device_) sender_->Disable(acks_, failed);
          unreadable_ = true;
          return failed;
        }
      }
    }
    if (!message_->sent.has_value()) message_->sent = message_->op->Test();
    if (message_->sent.has_value() && !message_->sent->ok()) return *message_->sent;
    if (!peer_checked) {
      if (absl::Status peer = transport_.PeerStatus(peer_); !peer.ok()) return peer;
    }
    if (now > ack_deadline_) {
      return absl::DeadlineExceededError(
          absl::StrCat("no ack from the decode worker ", absl::FormatDuration(ack_wait_),
                       " after the page reference (the worker is stopped, or its lane is stuck)"));
    }
    return std::nullopt;
  }
  // The message is shared by the pages it references: cancelled once.
  void Cancel() override {
    if (!message_->cancelled) message_->op->Cancel();
    message_->cancelled = true;
  }
  bool unreadable() const { return unreadable_; }

 private:
  const bool device_;  // The page is in a GPU arena (its failure message says so).
  std::shared_ptr<RefMessage> message_;
  const std::atomic<uint64_t>* word_;
  const uint64_t ticket_id_;
  PageTransport& transport_;
  const PeerId peer_;
  shm::PullSender* const sender_;
  const shm::RegionName acks_;
  const Clock& clock_;
  const absl::Duration ack_wait_;
  const absl::Time ack_deadline_;
  bool unreadable_ = false;
};

}  // namespace

Transfer::Transfer(PageTransport& transport, const Clock& clock, SenderOptions options,
                   Ticket ticket, PeerId peer, std::vector<SourcePage> pages,
                   std::optional<shm::PullSender::Acks> pull, absl::Status pull_refusal)
    : transport_(transport),
      clock_(clock),
      options_(options),
      ticket_(std::move(ticket)),
      peer_(peer),
      checksums_(pages.size(), 0),
      checksummed_(pages.size(), false),
      page_ops_(pages.size()),
      page_queued_(pages.size(), false),
      page_done_(pages.size(), false),
      next_heartbeat_(clock_.Now()),  // the first Poll renews the lease at once
      lease_length_(ticket_.lease_deadline - clock_.Now()),
      lease_deadline_(ticket_.lease_deadline),
      pull_(std::move(pull)),
      pull_refusal_(std::move(pull_refusal)) {
  if (pull_.has_value()) {
    message_path_ = options_.path;
    options_.path = "shm-pull";
  }
  ControlMessage heartbeat{.kind = WireKind::kHeartbeat,
                           .request_id = ticket_.request_id,
                           .ticket_id = ticket_.ticket_id,
                           .epoch = ticket_.epoch};
  heartbeat_bytes_ = EncodeControl(heartbeat);
  for (const SourcePage& page : pages) {
    pages_.push_back(page.bytes);
    elements_.push_back(page.element);
  }
}

Transfer::~Transfer() {
  if (released_) return;
  if (error_.ok() && options_.metrics != nullptr) options_.metrics->RecordFailure("abort");
  bool quiet = true;
  for (auto& op : page_ops_) {
    if (op != nullptr) op->Cancel();
  }
  if (commit_op_ != nullptr) commit_op_->Cancel();
  // One deadline for all of them: a stalled receiver costs kCancelWait, not kCancelWait a page.
  const absl::Time until = absl::Now() + kCancelWait;
  for (auto& op : page_ops_) {
    if (op != nullptr && !WaitOpUntil(transport_, *op, until)) quiet = false;
  }
  if (commit_op_ != nullptr && !WaitOp(transport_, *commit_op_, kCancelWait)) quiet = false;
  if (heartbeat_op_ != nullptr) WaitOp(transport_, *heartbeat_op_, kCancelWait);
  // Only a sender that knows none of its writes can still land may vouch for that; otherwise the
  // receiver falls back to the lease. Queued pages were never handed over: nothing to wait for.
  if (!quiet || !transport_.PeerStatus(peer_).ok()) return;
  ControlMessage fence{.kind = WireKind::kFence,
                       .request_id = ticket_.request_id,
                       .ticket_id = ticket_.ticket_id,
                       .epoch = ticket_.epoch};
  const std::vector<std::byte> bytes = EncodeControl(fence);
  auto op = transport_.Send(peer_, WireKind::kFence, {}, bytes);
  if (op.ok()) WaitOp(transport_, **op, kCancelWait);
}

absl::Status Transfer::Fail(absl::Status status) {
  if (error_.ok()) {
    error_ = status;
    if (options_.metrics != nullptr) options_.metrics->RecordFailure(SendFailureCause(error_));
  }
  queued_.clear();
  for (auto& op : page_ops_) {
    if (op != nullptr) op->Cancel();
  }
  return error_;
}

PageHeader Transfer::HeaderOf(uint32_t slot) const {
  return SlotHeader(ticket_, slot, elements_[slot], checksums_[slot]);
}

absl::Status Transfer::SendSlot(uint32_t slot) {
  if (!checksummed_[slot]) checksums_[slot] = PayloadChecksum(pages_[slot]);
  auto op = transport_.Send(peer_, WireKind::kPage, EncodePageHeader(HeaderOf(slot)), pages_[slot]);
  if (!op.ok()) return Fail(op.status());
  page_ops_[slot] = std::move(*op);
  in_flight_.push_back(slot);
  in_flight_bytes_ += pages_[slot].size();
  return absl::OkStatus();
}

void Transfer::EncodeDeviceRefs(const std::vector<uint32_t>& slots,
                                std::vector<std::byte>& out) const {
  if (options_.device_ref_version >= 3) {
    std::vector<shm::DeviceRefEntry> entries(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      entries[i].header = EncodePageHeader(HeaderOf(slots[i]));
      entries[i].offset = device_offsets_[slots[i]];
      entries[i].length = pages_[slots[i]].size();
    }
    shm::AppendDeviceRefBatch(*device_, entries, out);
    return;
  }
  out.reserve(slots.size() * (kPageHeaderBytes + shm::kDevicePageRefBytes));
  for (uint32_t slot : slots) {
    const shm::PageRef ref{
        .device = device_, .offset = device_offsets_[slot], .length = pages_[slot].size()};
    const std::vector<std::byte> entry =
        shm::EncodePageRefMessage(EncodePageHeader(HeaderOf(slot)), ref);
    out.insert(out.end(), entry.begin(), entry.end());
  }
}

size_t Transfer::RefsPerMessage(size_t queued) const {
  if (!device_.has_value() || options_.device_ref_version < 3) {
    return shm::MaxRefsPerMessage(device_.has_value());
  }
  // Version 3: as many as fit a message, but spread over the lanes when fewer are ready (each
  // lane lands its messages on its own stream), at least version 2's 16 a message (a layer
  // posted alone at a short prompt is a few dozen pages).
  const size_t lanes = static_cast<size_t>(std::max(1, transport_.lanes()));
  return std::clamp<size_t>((queued + lanes - 1) / lanes, shm::MaxRefsPerMessage(true),
                            shm::kMaxDeviceRefsPerBatch);
}

absl::Status Transfer::SendRefs(const std::vector<uint32_t>& slots) {
  auto message = std::make_shared<RefMessage>();
  if (device_.has_value()) {
    EncodeDeviceRefs(slots, message->bytes);  // Checksums given by PrepareDevice's caller.
  } else {
    const shm::SharedRegion& region = options_.shm_pull->pages();
    for (uint32_t slot : slots) {
      if (!checksummed_[slot]) checksums_[slot] = PayloadChecksum(pages_[slot]);
      const shm::PageRef ref{.region = region.name(),
                             .offset = region.OffsetOf(pages_[slot].data()),
                             .length = pages_[slot].size()};
      const std::vector<std::byte> entry =
          shm::EncodePageRefMessage(EncodePageHeader(HeaderOf(slot)), ref);
      message->bytes.insert(message->bytes.end(), entry.begin(), entry.end());
    }
  }
  auto sent = transport_.Send(peer_, WireKind::kPageRef, {}, message->bytes);
  if (!sent.ok()) return Fail(sent.status());
  message->op = std::move(*sent);
  const absl::Time ack_deadline = clock_.Now() + lease_length_;  // One clock read a message.
  for (uint32_t slot : slots) {
    page_ops_[slot] = std::make_unique<PullOp>(
        message, pull_->words + slot, ticket_.ticket_id, transport_, peer_, options_.shm_pull,
        ticket_.shm_pull->acks, clock_, lease_length_, ack_deadline, device_.has_value());
    in_flight_.push_back(slot);
    in_flight_bytes_ += pages_[slot].size();
  }
  return absl::OkStatus();
}

absl::Status Transfer::ResendAsMessage(uint32_t slot) {
  auto op = transport_.Send(peer_, WireKind::kPage, EncodePageHeader(HeaderOf(slot)), pages_[slot]);
  if (!op.ok()) return Fail(op.status());
  page_ops_[slot] = std::move(*op);  // The reference was delivered: its op is done with.
  return absl::OkStatus();
}

bool Transfer::Queue(uint32_t slot) {
  if (page_queued_[slot]) return false;
  if (pages_posted_ == 0) first_post_at_ = clock_.Now();
  page_queued_[slot] = true;
  queued_.push_back(slot);
  ++pages_posted_;
  return true;
}

void Transfer::ChecksumOnPool(const std::vector<uint32_t>& slots) {
  // Device pages are never read here (their checksums are the caller's).
  if (options_.checksum_pool == nullptr || slots.empty() || device_.has_value()) return;
  // Each task writes its own slot's entry; checksummed_ (a bit vector) is set afterwards on this
  // thread.
  options_.checksum_pool->Run(static_cast<int64_t>(slots.size()), [&](int64_t i) {
    const uint32_t slot = slots[static_cast<size_t>(i)];
    checksums_[slot] = PayloadChecksum(pages_[slot]);
  });
  for (uint32_t slot : slots) checksummed_[slot] = true;
}

absl::Status Transfer::Pump() {
  const bool refs = pull_.has_value() && !pull_unreadable_;
  // Pulled pages' references go several to a message (docs/protocol.md, "Batched references"),
  // a message as soon as it is full or nothing more fits the window.
  std::vector<uint32_t> batch;
  size_t batch_bytes = 0;
  const size_t per_message = refs ? RefsPerMessage(queued_.size()) : 1;
  while (!queued_.empty()) {
    const uint32_t slot = queued_.front();
    if (!(in_flight_.empty() && batch.empty()) &&
        in_flight_bytes_ + batch_bytes + pages_[slot].size() > options_.max_in_flight_bytes) {
      break;
    }
    queued_.pop_front();
    if (!refs) {
      PDSERVE_RETURN_IF_ERROR(SendSlot(slot));
      continue;
    }
    batch.push_back(slot);
    batch_bytes += pages_[slot].size();
    if (batch.size() == per_message) {
      PDSERVE_RETURN_IF_ERROR(SendRefs(batch));
      batch.clear();
      batch_bytes = 0;
    }
  }
  if (!batch.empty()) PDSERVE_RETURN_IF_ERROR(SendRefs(batch));
  return absl::OkStatus();
}

absl::Status Transfer::CheckDeviceChecksums() const {
  if (!device_.has_value()) return absl::OkStatus();
  for (size_t slot = 0; slot < checksummed_.size(); ++slot) {
    if (!checksummed_[slot]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "slot ", slot, " of a GPU-arena transfer has no checksum (SetDeviceChecksums)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Transfer::SetDeviceChecksums(std::span<const uint64_t> xxh3_by_slot) {
  PDSERVE_RETURN_IF_ERROR(error_);
  if (!device_.has_value() || pages_posted_ > 0) {
    return absl::FailedPreconditionError(
        "SetDeviceChecksums: only for a GPU-arena transfer, before its first post");
  }
  if (xxh3_by_slot.size() != checksums_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("SetDeviceChecksums: ", xxh3_by_slot.size(),
                                                   " checksums for ", checksums_.size(), " pages"));
  }
  for (size_t slot = 0; slot < checksums_.size(); ++slot) {
    checksums_[slot] = xxh3_by_slot[slot];
    checksummed_[slot] = true;
  }
  return absl::OkStatus();
}

absl::Status Transfer::PostLayer(uint32_t layer) {
  PDSERVE_RETURN_IF_ERROR(error_);
  if (commit_requested_) return absl::FailedPreconditionError("transfer already committed");
  PDSERVE_RETURN_IF_ERROR(CheckDeviceChecksums());
  std::vector<uint32_t> posted;
  for (uint32_t slot = 0; slot < ticket_.pages.size(); ++slot) {
    if (ticket_.pages[slot].layer == layer && Queue(slot)) posted.push_back(slot);
  }
  ChecksumOnPool(posted);
  return Pump();
}

absl::Status Transfer::PostAll() {
  PDSERVE_RETURN_IF_ERROR(error_);
  if (commit_requested_) return absl::FailedPreconditionError("transfer already committed");
  PDSERVE_RETURN_IF_ERROR(CheckDeviceChecksums());
  std::vector<uint32_t> posted;
  for (uint32_t slot = 0; slot < ticket_.pages.size(); ++slot) {
    if (Queue(slot)) posted.push_back(slot);
  }
  ChecksumOnPool(posted);
  return Pump();
}

absl::Status Transfer::Commit(int32_t prompt_tokens, int32_t first_token,
                              std::vector<int32_t> more_first_tokens) {
  PDSERVE_RETURN_IF_ERROR(error_);
  if (pages_posted_ != ticket_.pages.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "commit before every page was posted: ", pages_posted_, " of ", ticket_.pages.size()));
  }
  commit_ = ControlMessage{.kind = WireKind::kCommit,
                           .request_id = ticket_.request_id,
                           .ticket_id = ticket_.ticket_id,
                           .epoch = ticket_.epoch,
                           .pages_sent = static_cast<uint32_t>(pages_posted_),
                           .prompt_tokens = prompt_tokens,
                           .first_token = first_token,
                           .more_first_tokens = std::move(more_first_tokens)};
  commit_requested_ = true;
  return absl::OkStatus();
}

absl::Status Transfer::SendCommit() {
  // Every page has been sent, so every checksum is known.
  uint32_t num_layers = 0;
  for (const PageDescriptor& page : ticket_.pages)
    num_layers = std::max(num_layers, page.layer + 1);
  std::vector<std::vector<uint64_t>> per_layer(num_layers);
  for (size_t slot = 0; slot < ticket_.pages.size(); ++slot) {
    per_layer[ticket_.pages[slot].layer].push_back(checksums_[slot]);
  }
  for (const auto& checksums : per_layer) commit_.layer_digests.push_back(LayerDigest(checksums));
  commit_bytes_ = EncodeControl(commit_);
  auto op = transport_.Send(peer_, WireKind::kCommit, {}, commit_bytes_);
  if (!op.ok()) return Fail(op.status());
  commit_op_ = std::move(*op);
  return absl::OkStatus();
}

void Transfer::SendHeartbeatIfDue() {
  if (ticket_.heartbeat_interval <= absl::ZeroDuration() || clock_.Now() < next_heartbeat_) return;
  if (heartbeat_op_ != nullptr && !heartbeat_op_->Test().has_value()) return;
  const absl::Time now = clock_.Now();
  next_heartbeat_ = now + ticket_.heartbeat_interval;
  auto op = transport_.Send(peer_, WireKind::kHeartbeat, {}, heartbeat_bytes_);
  if (!op.ok()) return;
  heartbeat_op_ = std::move(*op);
  lease_deadline_ = std::max(lease_deadline_, now + lease_length_);
}

absl::Status Transfer::CollectPages() {
  size_t kept = 0;
  // Poll checked the endpoint just before; pulled pages take this round's time and that check.
  const absl::Time now = clock_.Now();
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    const uint32_t slot = in_flight_[i];
    auto* pull = pull_.has_value() ? dynamic_cast<PullOp*>(page_ops_[slot].get()) : nullptr;
    std::optional<absl::Status> status =
        pull != nullptr ? pull->TestAt(now, /*peer_checked=*/true) : page_ops_[slot]->Test();
    if (!status.has_value()) {
      in_flight_[kept++] = slot;
      continue;
    }
    if (!status->ok() && pull_.has_value() && !device_.has_value()) {
      if (pull != nullptr && pull->unreadable()) {
        // The decode worker could not read this worker's region (e.g. it runs as another user
        // and cannot open the memfd, which this worker's check of its ack table cannot tell): it
        // left the slot empty, so the page goes again as a message, and so do the rest.
        pull_unreadable_ = true;
        options_.path = message_path_;
        PDSERVE_RETURN_IF_ERROR(ResendAsMessage(slot));
        in_flight_[kept++] = slot;
        continue;
      }
    }
    if (!status->ok()) {
      // The failed send stays in flight for the destructor, which cancels and waits for it.
      in_flight_.erase(in_flight_.begin() + static_cast<ptrdiff_t>(kept),
                       in_flight_.begin() + static_cast<ptrdiff_t>(i));
      return Fail(
          absl::Status(status->code(), absl::StrCat("page slot ", slot, " of ticket ",
                                                    ticket_.ticket_id, ": ", status->message())));
    }
    page_ops_[slot].reset();
    page_done_[slot] = true;
    in_flight_bytes_ -= pages_[slot].size();
    ++pages_completed_;
  }
  in_flight_.resize(kept);
  return absl::OkStatus();
}

absl::StatusOr<bool> Transfer::Poll() {
  PDSERVE_RETURN_IF_ERROR(error_);
  if (delivered_) return true;
  transport_.Progress();
  if (absl::Status peer = transport_.PeerStatus(peer_); !peer.ok()) return Fail(peer);
  if (clock_.Now() > lease_deadline_) {
    return Fail(absl::DeadlineExceededError(
        absl::StrCat("lease of ticket ", ticket_.ticket_id, " expired during the transfer")));
  }
  PDSERVE_RETURN_IF_ERROR(CollectPages());
  PDSERVE_RETURN_IF_ERROR(Pump());
  SendHeartbeatIfDue();
  if (commit_requested_ && commit_op_ == nullptr && pages_completed_ == ticket_.pages.size()) {
    PDSERVE_RETURN_IF_ERROR(SendCommit());
  }
  if (commit_op_ != nullptr) {
    std::optional<absl::Status> status = commit_op_->Test();
    if (status.has_value()) {
      if (!status->ok()) return Fail(*status);
      delivered_ = true;
      if (options_.metrics != nullptr) {
        options_.metrics->RecordTransfer(options_.path, transport_.lanes(), ticket_.total_bytes(),
                                         clock_.Now() - first_post_at_);
      }
    }
  }
  return delivered_;
}

absl::Status Transfer::Release() {
  if (!delivered_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ticket ", ticket_.ticket_id, " released before its commit was delivered"));
  }
  if (heartbeat_op_ != nullptr) WaitOp(transport_, *heartbeat_op_, kCancelWait);
  heartbeat_op_.reset();
  commit_op_.reset();
  released_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transfer>> TransferSender::Prepare(
    const Ticket& ticket, std::vector<std::span<const std::byte>> pages) {
  std::vector<SourcePage> sources;
  for (size_t slot = 0; slot < pages.size(); ++slot) {
    sources.push_back({pages[slot], slot < ticket.pages.size() ? ticket.pages[slot].element
                                                               : serving::ElementType::kFloat32});
  }
  return PrepareWithElements(ticket, std::move(sources));
}

absl::StatusOr<PeerId> TransferSender::Connect(
    const Ticket& ticket, const std::vector<std::pair<uint64_t, serving::ElementType>>& sizes) {
  if (sizes.size() != ticket.pages.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ticket ", ticket.ticket_id, " names ",
                                                   ticket.pages.size(), " pages, got ",
                                                   sizes.size(), " sources"));
  }
  for (size_t slot = 0; slot < sizes.size(); ++slot) {
    const auto [bytes, element] = sizes[slot];
    PDSERVE_ASSIGN_OR_RETURN(const uint64_t wire, WireBytes(ticket.pages[slot], element));
    if (bytes != wire) {
      return absl::InvalidArgumentError(absl::StrCat(
          "slot ", slot, " is ", bytes, " bytes of ", serving::ElementTypeName(element),
          ", the ticket expects ", wire, " (its page: ", ticket.pages[slot].bytes, " bytes of ",
          serving::ElementTypeName(ticket.pages[slot].element), ")"));
    }
  }
  if (clock_.Now() > ticket.lease_deadline) {
    if (options_.metrics != nullptr) options_.metrics->RecordFailure("timeout");
    return absl::DeadlineExceededError(
        absl::StrCat("lease of ticket ", ticket.ticket_id, " is already over"));
  }
  absl::StatusOr<PeerId> peer =
      transport_.Connect(ticket.worker_address, ticket.receiver_incarnation);
  if (!peer.ok() && options_.metrics != nullptr) options_.metrics->RecordFailure("connect");
  return peer;
}

absl::StatusOr<std::unique_ptr<Transfer>> TransferSender::PrepareWithElements(
    const Ticket& ticket, std::vector<SourcePage> pages) {
  if (ticket.shm_pull.has_value() && !ticket.shm_pull->device_pci_bus_id.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ticket ", ticket.ticket_id,
                     ": the decode worker lands this request in GPU "
                     "pages (CUDA IPC), which take only pages of a GPU arena, not host pages"));
  }
  std::vector<std::pair<uint64_t, serving::ElementType>> sizes;
  for (const SourcePage& page : pages) sizes.emplace_back(page.bytes.size(), page.element);
  PDSERVE_ASSIGN_OR_RETURN(const PeerId peer, Connect(ticket, sizes));
  std::optional<shm::PullSender::Acks> pull;
  absl::Status pull_refusal;
  if (options_.shm_pull != nullptr && ticket.shm_pull.has_value()) {
    const shm::SharedRegion& region = options_.shm_pull->pages();
    for (size_t slot = 0; slot < pages.size() && pull_refusal.ok(); ++slot) {
      if (!region.Contains(pages[slot].bytes.data(), pages[slot].bytes.size())) {
        pull_refusal = absl::FailedPreconditionError(
            absl::StrCat("shm pull: slot ", slot, "'s page lies outside the shared region"));
      }
    }
    if (pull_refusal.ok()) {
      absl::StatusOr<shm::PullSender::Acks> acks =
          options_.shm_pull->AcksFor(*ticket.shm_pull, pages.size());
      if (acks.ok()) {
        pull = std::move(*acks);
      } else {
        pull_refusal = acks.status();
      }
    }
  } else if (options_.shm_pull != nullptr) {
    pull_refusal = absl::FailedPreconditionError(
        "shm pull: the ticket carries no shm-pull offer (the decode worker's transfer.shm_pull is "
        "off, or its ack table had no free words for the ticket)");
  }
  return std::unique_ptr<Transfer>(new Transfer(transport_, clock_, options_, ticket, peer,
                                                std::move(pages), std::move(pull),
                                                std::move(pull_refusal)));
}

absl::StatusOr<std::unique_ptr<Transfer>> TransferSender::PrepareDevice(const Ticket& ticket,
                                                                        DevicePages pages) {
  if (!ticket.shm_pull.has_value() || ticket.shm_pull->device_pci_bus_id.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ticket ", ticket.ticket_id,
                     ": the decode worker's pages are not GPU memory "
                     "(no device in its offer): pages of a GPU arena cannot go to it"));
  }
  if (options_.shm_pull == nullptr) {
    return absl::FailedPreconditionError("GPU arena pages need the sender's PullSender");
  }
  if (pages.arena.boot_id != ticket.shm_pull->boot_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda ipc: the decode worker runs on another host (boot id ",
                     ticket.shm_pull->boot_id, ", the arena's ", pages.arena.boot_id, ")"));
  }
  std::vector<std::pair<uint64_t, serving::ElementType>> sizes;
  for (size_t slot = 0; slot < pages.pages.size(); ++slot) {
    const DeviceSourcePage& page = pages.pages[slot];
    if (page.offset > pages.arena.bytes || page.length > pages.arena.bytes - page.offset) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slot, "'s page [", page.offset, ", +",
                                                     page.length, ") lies outside the ",
                                                     pages.arena.bytes, "-byte GPU arena"));
    }
    sizes.emplace_back(page.length, page.element);
  }
  PDSERVE_ASSIGN_OR_RETURN(const PeerId peer, Connect(ticket, sizes));
  PDSERVE_ASSIGN_OR_RETURN(shm::PullSender::Acks acks,
                           options_.shm_pull->AcksFor(*ticket.shm_pull, pages.pages.size()));
  // The spans only carry each page's size (never read: the checksums are given).
  std::vector<SourcePage> sources;
  for (const DeviceSourcePage& page : pages.pages) {
    sources.push_back(
        {{static_cast<const std::byte*>(nullptr), static_cast<size_t>(page.length)}, page.element});
  }
  std::unique_ptr<Transfer> transfer(new Transfer(transport_, clock_, options_, ticket, peer,
                                                  std::move(sources), std::move(acks),
                                                  absl::OkStatus()));
  transfer->options_.path = "cuda-ipc";
  transfer->device_ = std::move(pages.arena);
  for (size_t slot = 0; slot < pages.pages.size(); ++slot) {
    transfer->device_offsets_.push_back(pages.pages[slot].offset);
    if (pages.checksums_pending) continue;  // Transfer::SetDeviceChecksums gives them.
    transfer->checksums_[slot] = pages.pages[slot].xxh3;
    transfer->checksummed_[slot] = true;
  }
  return transfer;
}

}  // namespace pdserve::kv
