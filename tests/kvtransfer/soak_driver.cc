#include "tests/kvtransfer/soak_driver.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/transfer_plan.h"

namespace pdserve::kv::testing {
namespace {

// Two page kinds, so both loopback paths run: 512-byte pages go by rendezvous (landed in the
// receive end's next Progress), 256-byte ones eagerly.
constexpr int64_t kBigPages = 24;
constexpr int64_t kSmallPages = 16;
constexpr size_t kMaxLive = 8;
constexpr absl::Duration kLease = absl::Seconds(1);
constexpr absl::Duration kGrace = absl::Milliseconds(100);
// A request not finished after this much fake time breaks liveness.
constexpr absl::Duration kLiveness = absl::Seconds(20);

bool IsPoison(std::span<const std::byte> page) {
  for (size_t i = 0; i + 4 <= page.size(); i += 4) {
    uint32_t word;
    std::memcpy(&word, page.data() + i, 4);
    if (word != serving::kPoisonWord) return false;
  }
  return true;
}

}  // namespace

const char* SoakFaultName(SoakFault fault) {
  static constexpr const char* kNames[] = {"none",         "flipped byte",      "dropped page",
                                           "duplicate",    "reordered (grace)", "reordered (late)",
                                           "foreign",      "stale epoch",       "abort + reuse",
                                           "silent sender"};
  return kNames[static_cast<int>(fault)];
}

std::string SoakCounts::Summary() const {
  std::string out;
  for (int fault = 0; fault < kNumSoakFaults; ++fault) {
    absl::StrAppend(&out, SoakFaultName(static_cast<SoakFault>(fault)), ": ", by_fault[fault], " (",
                    receive_side[fault], " at the receiver); ");
  }
  absl::StrAppend(&out, "aborted pages reused at once: ", reused_at_once,
                  "; page checks: ", page_checks);
  return out;
}

struct SoakDriver::Request {
  uint64_t id = 0;
  SoakFault fault = SoakFault::kNone;
  bool receive_side = false;
  serving::PageTable table;
  std::vector<int> pages;  // Index into page_bytes_, by slot.
  Ticket ticket;
  std::vector<std::vector<std::byte>> sources;
  std::unique_ptr<Transfer> transfer;
  std::optional<TransferOutcome> outcome;  // Pushed by the receiver.
  bool released = false;
  size_t flip_offset = 0;
  uint64_t started_event = 0;
  uint64_t act_at_event = 0;  // kAborted: abort then; kSilent: last poll then.
  absl::Time started_at;
};

SoakDriver::SoakDriver(uint64_t seed) : rng_(seed) {
  pool_ = *serving::PagePool::Create(
      {.kinds = {{.name = "big", .num_pages = kBigPages, .rows_per_page = 8, .row_bytes = 64},
                 {.name = "small", .num_pages = kSmallPages, .rows_per_page = 4, .row_bytes = 64}},
       .poison_freed = true});
  // Every page's bytes, found once by owning the whole pool (they stay put).
  serving::PageTable all = *pool_->Allocate(0, {kBigPages, kSmallPages});
  for (const auto& kind : all.pages) {
    for (const serving::PageHandle& handle : kind) page_bytes_.push_back(*pool_->Data(0, handle));
  }
  (void)pool_->Free(all);
  auto faults = std::make_unique<FaultInjectingReceiveTransport>(network_.NewReceiveEnd(), clock_);
  receive_faults_ = faults.get();
  receiver_ = std::make_unique<TransferReceiver>(
      std::move(faults),
      ReceiverOptions{.lease = kLease,
                      .heartbeat_interval = absl::Milliseconds(250),
                      .missing_grace = kGrace,
                      .incarnation = 1},
      clock_,
      [this](uint64_t ticket_id, uint64_t, const absl::Status&) { released_.push_back(ticket_id); },
      [this](uint64_t ticket_id, uint64_t request_id, const TransferOutcome& outcome) {
        auto found = requests_.find(request_id);
        if (found != requests_.end() && found->second->ticket.ticket_id == ticket_id) {
          found->second->outcome = outcome;
        }
      });
  send_end_ = network_.NewSendEnd();
  send_faults_ = std::make_unique<FaultInjectingTransport>(*send_end_, clock_);
  sender_ = std::make_unique<TransferSender>(*send_faults_, clock_);
}

SoakDriver::~SoakDriver() {
  for (auto& [id, request] : requests_) request->transfer.reset();
  receiver_.reset();
}

absl::Status SoakDriver::Run(uint64_t requests) {
  target_ = requests;
  while (counts_.finished < requests) {
    while (started_ < requests && requests_.size() < kMaxLive && rng_() % 2 == 0) {
      if (absl::Status started = Start(); !started.ok()) {
        if (started.code() == absl::StatusCode::kResourceExhausted) break;
        return started;
      }
    }
    if (absl::Status stepped = Step(); !stepped.ok()) {
      return absl::InternalError(absl::StrCat("event ", counts_.events, ": ", stepped.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status SoakDriver::Start(std::optional<serving::PageDemand> wanted) {
  const serving::PageDemand demand = wanted.value_or(
      serving::PageDemand{static_cast<int64_t>(rng_() % 4), static_cast<int64_t>(rng_() % 3)});
  if (demand[0] + demand[1] == 0 || !pool_->CanAllocate(demand)) {
    return absl::ResourceExhaustedError("pool full");
  }
  auto request = std::make_unique<Request>();
  Request& r = *request;
  r.id = next_request_++;
  r.table = *pool_->Allocate(r.id, demand);
  ReceiveSpec spec{.request_id = r.id, .epoch = TableEpoch(r.table)};
  for (int kind = 0; kind < 2; ++kind) {
    for (const serving::PageHandle& handle : r.table.pages[kind]) {
      const uint32_t slot = static_cast<uint32_t>(spec.pages.size());
      std::span<std::byte> bytes = *pool_->Data(r.id, handle);
      spec.pages.push_back({.layer = slot / 2,
                            .page_index = slot,
                            .token_begin = slot * 64,
                            .token_end = slot * 64 + 64,
                            .bytes = bytes.size()});
      spec.destinations.push_back(bytes);
      r.pages.push_back(kind == 0 ? handle.page : static_cast<int>(kBigPages) + handle.page);
      FillPattern(r.sources.emplace_back(bytes.size()), r.id, slot);
    }
  }
  auto ticket = receiver_->Expect(std::move(spec));
  if (!ticket.ok()) return ticket.status();
  r.ticket = *ticket;
  r.fault = static_cast<SoakFault>(rng_() % kNumSoakFaults);
  r.started_event = counts_.events;
  r.started_at = clock_.Now();
  InjectFault(r);
  auto transfer = sender_->Prepare(r.ticket, {r.sources.begin(), r.sources.end()});
  if (!transfer.ok()) return transfer.status();
  r.transfer = std::move(*transfer);
  if (absl::Status posted = r.transfer->PostAll(); !posted.ok()) return posted;
  if (absl::Status committed = r.transfer->Commit(256, 1); !committed.ok()) return committed;
  ++started_;
  ++counts_.by_fault[static_cast<int>(r.fault)];
  if (r.receive_side) ++counts_.receive_side[static_cast<int>(r.fault)];
  requests_[r.id] = std::move(request);
  return absl::OkStatus();
}

void SoakDriver::InjectFault(Request& r) {
  using Action = FaultRule::Action;
  const uint32_t slot = static_cast<uint32_t>(rng_() % r.pages.size());
  r.receive_side = rng_() % 2 == 0;
  FaultRule rule{.slot = slot, .ticket_id = r.ticket.ticket_id};
  switch (r.fault) {
    case SoakFault::kNone:
      return;
    case SoakFault::kFlippedByte:
      rule.action = Action::kCorruptByte;
      rule.offset = r.flip_offset = rng_() % 256;
      break;
    case SoakFault::kDropped:
      rule.action = Action::kDrop;
      break;
    case SoakFault::kDuplicated:
      rule.action = Action::kDuplicate;
      break;
    case SoakFault::kReorderedInGrace:
    case SoakFault::kReorderedLate:
      // Only the receiver can hold a page past the commit: the sender commits after every send.
      r.receive_side = true;
      rule.action = Action::kDelay;
      rule.delay = r.fault == SoakFault::kReorderedLate ? 3 * kGrace : kGrace / 3;
      break;
    case SoakFault::kForeign: {
      const bool other_ticket = rng_() % 2 == 0;
      rule.action = Action::kRewriteHeader;
      rule.rewrite = [other_ticket](PageHeader& header) {
        (other_ticket ? header.ticket_id : header.request_id) += uint64_t{1} << 40;
      };
      break;
    }
    case SoakFault::kStaleEpoch:
      rule.action = Action::kRewriteHeader;
      rule.rewrite = [](PageHeader& header) { header.epoch -= 1; };
      break;
    case SoakFault::kAborted:
    case SoakFault::kSilent:
      // A page held back for good, so the request cannot verify first.
      r.receive_side = false;
      rule.action = Action::kDelay;
      rule.delay = absl::Hours(1);
      r.act_at_event = counts_.events + 2 + rng_() % 5;
      break;
  }
  if (r.receive_side) {
    receive_faults_->AddRule(std::move(rule));
  } else {
    send_faults_->AddRule(std::move(rule));
  }
}

absl::Status SoakDriver::Step() {
  ++counts_.events;
  for (auto& [id, request] : requests_) {
    Request& r = *request;
    if (r.transfer == nullptr) continue;
    if (r.fault == SoakFault::kAborted && counts_.events >= r.act_at_event) {
      if (absl::Status aborted = receiver_->Abort(r.ticket.ticket_id); !aborted.ok()) {
        return absl::InternalError(absl::StrCat("request ", id, ": Abort: ", aborted.ToString()));
      }
      r.transfer.reset();  // The prefill side stops too: cancels its sends and fences.
      continue;
    }
    if (r.fault == SoakFault::kSilent && counts_.events > r.act_at_event) continue;
    absl::StatusOr<bool> polled = r.transfer->Poll();
    if (!polled.ok()) {
      r.transfer.reset();  // A faulted request's sender gives up; the receiver decides.
    } else if (*polled) {
      (void)r.transfer->Release();
      r.transfer.reset();
    }
  }
  receiver_->Progress();
  for (uint64_t ticket_id : released_) {
    for (auto& [id, request] : requests_) {
      if (request->ticket.ticket_id == ticket_id) request->released = true;
    }
  }
  released_.clear();
  if (absl::Status pages = CheckPages(); !pages.ok()) return pages;
  std::vector<Request*> done;
  for (auto& [id, request] : requests_) {
    const Request& r = *request;
    const bool verified = r.outcome && r.outcome->state == TransferState::kVerified;
    if (verified || r.released) done.push_back(request.get());
    if (clock_.Now() - r.started_at > kLiveness) {
      return absl::InternalError(absl::StrCat("request ", id, " (", SoakFaultName(r.fault),
                                              ") undecided after ",
                                              absl::FormatDuration(kLiveness)));
    }
  }
  for (Request* r : done) {
    if (absl::Status finished = Finish(*r); !finished.ok()) return finished;
  }
  clock_.Advance(absl::Milliseconds(rng_() % 21));
  return absl::OkStatus();
}

absl::Status SoakDriver::Finish(Request& r) {
  if (absl::Status checked = CheckOutcome(r); !checked.ok()) {
    return absl::InternalError(absl::StrCat("request ", r.id, " (", SoakFaultName(r.fault),
                                            r.receive_side ? ", at the receiver" : "",
                                            "): ", checked.message()));
  }
  const bool aborted = r.fault == SoakFault::kAborted;
  const std::set<int> freed(r.pages.begin(), r.pages.end());
  r.transfer.reset();
  if (absl::Status freed_ok = pool_->Free(r.table); !freed_ok.ok()) return freed_ok;
  requests_.erase(r.id);
  ++counts_.finished;
  // An aborted request's pages go to a new request at once: it takes every free page (the pool
  // hands out the least recently freed first).
  if (aborted && started_ < target_ && requests_.size() < kMaxLive) {
    if (Start(serving::PageDemand{pool_->pages_free(0), pool_->pages_free(1)}).ok()) {
      const Request& next = *requests_.rbegin()->second;
      for (int page : next.pages) {
        if (freed.contains(page)) {
          ++counts_.reused_at_once;
          break;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SoakDriver::CheckOutcome(const Request& r) const {
  const std::optional<TransferOutcome>& outcome = r.outcome;
  if (!outcome.has_value()) return absl::InternalError("released without a pushed outcome");
  std::optional<IsolationError> want;
  switch (r.fault) {
    case SoakFault::kNone:
    case SoakFault::kReorderedInGrace:
      if (outcome->state != TransferState::kVerified) {
        return absl::InternalError(
            absl::StrCat("a clean request did not verify: ", outcome->status.ToString()));
      }
      for (size_t slot = 0; slot < r.pages.size(); ++slot) {
        if (!MatchesPattern(page_bytes_[r.pages[slot]].first(r.sources[slot].size()), r.id,
                            static_cast<uint32_t>(slot))) {
          return absl::InternalError(absl::StrCat("verified, but slot ", slot, " differs"));
        }
      }
      return absl::OkStatus();
    case SoakFault::kAborted:
      if (outcome->state != TransferState::kAborted ||
          outcome->status.code() != absl::StatusCode::kCancelled) {
        return absl::InternalError(absl::StrCat("want aborted, got ", outcome->status.ToString()));
      }
      return absl::OkStatus();
    case SoakFault::kFlippedByte:
      want = IsolationError::kChecksum;
      break;
    case SoakFault::kDropped:
    case SoakFault::kReorderedLate:
      want = IsolationError::kMissing;
      break;
    case SoakFault::kDuplicated:
      want = IsolationError::kDuplicate;
      break;
    case SoakFault::kForeign:
      want = IsolationError::kHeader;
      break;
    case SoakFault::kStaleEpoch:
      want = IsolationError::kEpoch;
      break;
    case SoakFault::kSilent:
      want = IsolationError::kLease;
      break;
  }
  if (outcome->state != TransferState::kFailed || GetIsolationError(outcome->status) != want) {
    return absl::InternalError(absl::StrCat("want isolation error ", IsolationErrorName(*want),
                                            ", got ", outcome->status.ToString()));
  }
  return absl::OkStatus();
}

absl::Status SoakDriver::CheckPages() {
  std::vector<std::pair<const Request*, size_t>> owner(page_bytes_.size(), {nullptr, 0});
  for (const auto& [id, request] : requests_) {
    for (size_t slot = 0; slot < request->pages.size(); ++slot) {
      owner[request->pages[slot]] = {request.get(), slot};
    }
  }
  std::vector<std::byte> flipped;
  for (size_t page = 0; page < page_bytes_.size(); ++page) {
    const std::span<const std::byte> bytes = page_bytes_[page];
    const auto [r, slot] = owner[page];
    bool ok = IsPoison(bytes);
    if (!ok && r != nullptr) {
      ok = MatchesPattern(bytes, r->id, static_cast<uint32_t>(slot));
      if (!ok && r->fault == SoakFault::kFlippedByte) {
        flipped.assign(bytes.begin(), bytes.end());
        flipped[r->flip_offset % flipped.size()] ^= std::byte{0xFF};
        ok = MatchesPattern(flipped, r->id, static_cast<uint32_t>(slot));
      }
    }
    if (!ok) {
      return absl::InternalError(absl::StrCat(
          "pool page ", page,
          r == nullptr ? " (free)" : absl::StrCat(" (request ", r->id, " slot ", slot, ")"),
          " holds bytes that are not its owner's"));
    }
  }
  counts_.page_checks += page_bytes_.size();
  return absl::OkStatus();
}

}  // namespace pdserve::kv::testing
