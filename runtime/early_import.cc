#include "runtime/early_import.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "kernels/env_switch.h"
#include "spdlog/spdlog.h"

namespace pdserve::runtime {
namespace {

using State = EarlyImportState;
using Event = EarlyImportEvent;

// The states in which layers are still imported and copies checked.
bool Importing(State s) { return s == State::kImporting || s == State::kVerified; }
// The states in which the import holds its slot (kFailed and kCancelled gave it back, or their
// running call does).
bool HoldsSlot(State s) { return Importing(s) || s == State::kCopied || s == State::kReady; }

const char* EventName(Event e) {
  switch (e) {
    case Event::kAllCopied:
      return "all copied";
    case Event::kVerified:
      return "verified";
    case Event::kTaken:
      return "taken";
    case Event::kImportFailed:
      return "import failed";
    case Event::kCancel:
      return "cancel";
  }
  return "?";
}

}  // namespace

const char* EarlyImportStateName(EarlyImportState state) {
  switch (state) {
    case State::kImporting:
      return "importing";
    case State::kCopied:
      return "copied";
    case State::kVerified:
      return "verified";
    case State::kReady:
      return "ready";
    case State::kTaken:
      return "taken";
    case State::kFailed:
      return "failed";
    case State::kCancelled:
      return "cancelled";
  }
  return "?";
}

absl::StatusOr<EarlyImportState> NextEarlyImportState(EarlyImportState state,
                                                      EarlyImportEvent event) {
  switch (event) {
    case Event::kAllCopied:
      if (state == State::kImporting) return State::kCopied;
      if (state == State::kVerified) return State::kReady;
      break;
    case Event::kVerified:
      if (state == State::kImporting) return State::kVerified;
      if (state == State::kCopied) return State::kReady;
      break;
    case Event::kTaken:
      if (state == State::kReady) return State::kTaken;
      break;
    case Event::kImportFailed:
      if (Importing(state) || state == State::kCopied) return State::kFailed;
      break;
    case Event::kCancel:
      if (state == State::kFailed || state == State::kCancelled) return state;
      if (state != State::kTaken) return State::kCancelled;
      break;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "early import: event '", EventName(event), "' in state '", EarlyImportStateName(state), "'"));
}

bool BatchEarlyImportLayers() {
  return kernels::ReadSwitchFlag("PDSERVE_EARLY_IMPORT_BATCH", true,
                                 "the default (queued layers imported in one call)");
}

EarlyImporter::EarlyImporter(SlotImporter* slots, int64_t layers)
    : EarlyImporter(slots, layers, BatchEarlyImportLayers()) {}

EarlyImporter::EarlyImporter(SlotImporter* slots, int64_t layers, bool batch_layers)
    : slots_(slots), layers_(layers), batch_layers_(batch_layers), thread_([this] { Run(); }) {}

EarlyImporter::~EarlyImporter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  absl::MutexLock lock(&mu_);
  for (auto& [id, record] : records_) {
    if (record.state != State::kFailed && record.state != State::kCancelled) slots_->Release(id);
  }
}

void EarlyImporter::Apply(serving::RequestId id, Record& record, EarlyImportEvent event) {
  absl::StatusOr<State> next = NextEarlyImportState(record.state, event);
  if (next.ok()) {
    record.state = *next;
    return;
  }
  spdlog::error("sequence {}: {}", id, next.status().ToString());
  if (!HoldsSlot(record.state)) return;  // failed or cancelled already: nothing left to give back
  if (record.busy) {
    if (record.fault.ok()) record.fault = next.status();
    return;
  }
  record.busy = true;
  Fail(id, next.status());
}

void EarlyImporter::ReleaseSlot(serving::RequestId id) {
  mu_.Unlock();
  slots_->Release(id);
  mu_.Lock();
}

absl::Status EarlyImporter::Begin(serving::RequestId id, int64_t position, int64_t total_tokens,
                                  std::shared_ptr<const serving::PageLease> pages) {
  return BeginWith(id, std::move(pages), /*device=*/false,
                   [&] { return slots_->Claim(id, position, total_tokens); });
}

absl::Status EarlyImporter::BeginFromDevice(serving::RequestId id, int64_t position,
                                            int64_t total_tokens, DevicePageSource source,
                                            std::shared_ptr<const serving::PageLease> pages) {
  return BeginWith(id, std::move(pages), /*device=*/true, [&] {
    return slots_->ClaimFromDevice(id, position, total_tokens, std::move(source));
  });
}

absl::Status EarlyImporter::BeginWith(serving::RequestId id,
                                      std::shared_ptr<const serving::PageLease> pages, bool device,
                                      const std::function<absl::Status()>& claim) {
  {
    absl::MutexLock lock(&mu_);
    if (records_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already importing"));
    }
  }
  // Claimed outside mu_: the slot importer may wait for the model's step in flight.
  absl::Status claimed = claim();
  if (!claimed.ok()) return claimed;
  absl::MutexLock lock(&mu_);
  Record& record = records_[id];
  record.queued.assign(static_cast<size_t>(layers_), 0);
  record.pages = std::move(pages);
  record.device = device;
  return absl::OkStatus();
}

void EarlyImporter::LayerArrived(serving::RequestId id, int64_t layer) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end() || !Importing(it->second.state) || layer < 0 || layer >= layers_) {
    return;
  }
  char& queued = it->second.queued[static_cast<size_t>(layer)];
  if (queued) return;
  queued = 1;
  queue_.emplace_back(id, layer);
}

void EarlyImporter::Verified(serving::RequestId id) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return;
  const State s = it->second.state;
  if (s == State::kImporting || s == State::kCopied) Apply(id, it->second, Event::kVerified);
}

void EarlyImporter::Cancel(serving::RequestId id) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return;
  const State before = it->second.state;
  if (before == State::kTaken) return;
  Apply(id, it->second, Event::kCancel);
  // A failed or cancelled import already gave its slot back; a busy one gives it back when its
  // call returns (AfterCall).
  if (it->second.busy) return;
  records_.erase(it);
  if (before != State::kFailed && before != State::kCancelled) ReleaseSlot(id);
}

absl::StatusOr<bool> EarlyImporter::Ready(serving::RequestId id) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end() || it->second.state == State::kCancelled) {
    return absl::NotFoundError(absl::StrCat("sequence ", id, " has no early import"));
  }
  if (it->second.state == State::kFailed) {
    absl::Status error = it->second.error;
    if (!it->second.busy) records_.erase(it);
    return error;
  }
  return it->second.state == State::kReady;
}

absl::Status EarlyImporter::Take(serving::RequestId id) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence ", id, " has no early import"));
  }
  absl::StatusOr<State> next = NextEarlyImportState(it->second.state, Event::kTaken);
  if (!next.ok()) return next.status();
  records_.erase(it);
  return absl::OkStatus();
}

std::optional<EarlyImportState> EarlyImporter::StateOf(serving::RequestId id) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return std::nullopt;
  return it->second.state;
}

int64_t EarlyImporter::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(records_.size());
}

void EarlyImporter::Fail(serving::RequestId id, absl::Status error) {
  // Still busy while the slot goes back, so a Cancel meanwhile leaves the release to this call;
  // kFailed is published with the slot already free.
  ReleaseSlot(id);
  auto it = records_.find(id);
  Record& record = it->second;
  record.busy = false;
  record.pages.reset();  // no call reads them any more
  if (record.state == State::kCancelled) {
    records_.erase(it);
    return;
  }
  record.error = std::move(error);
  // kImportFailed for a failed call; an illegal event's failure (a bug) may come in kReady.
  const absl::StatusOr<State> next = NextEarlyImportState(record.state, Event::kImportFailed);
  record.state = next.ok() ? *next : State::kFailed;
}

void EarlyImporter::AfterCall(serving::RequestId id) {
  auto it = records_.find(id);
  it->second.busy = false;
  if (it->second.state != State::kCancelled) return;
  records_.erase(it);
  ReleaseSlot(id);
}

bool EarlyImporter::Work() {
  if (!queue_.empty()) {
    const serving::RequestId id = queue_.front().first;
    // The front's layer and, batching, every other layer of its request queued now (in order).
    std::vector<int64_t> layers = {queue_.front().second};
    queue_.pop_front();
    auto it = records_.find(id);
    if (it == records_.end() || !Importing(it->second.state)) return true;
    if (batch_layers_ && it->second.device) {
      std::erase_if(queue_, [&](const std::pair<serving::RequestId, int64_t>& queued) {
        if (queued.first != id) return false;
        layers.push_back(queued.second);
        return true;
      });
    }
    it->second.busy = true;
    mu_.Unlock();
    const absl::Status imported = slots_->ImportLayers(id, layers);
    mu_.Lock();
    it = records_.find(id);  // busy records are never erased
    if (it->second.state == State::kCancelled) {
      AfterCall(id);
      return true;
    }
    if (imported.ok() && it->second.fault.ok()) {
      it->second.busy = false;
      it->second.imported += static_cast<int64_t>(layers.size());
      return true;
    }
    if (!imported.ok()) {
      spdlog::error("sequence {}: early import of layers {} failed: {}", id,
                    absl::StrJoin(layers, ","), imported.ToString());
    }
    Fail(id, imported.ok() ? it->second.fault : imported);
    return true;
  }
  // The copy checks of the imports whose layers are all enqueued.
  std::vector<serving::RequestId> copying;
  for (const auto& [id, record] : records_) {
    if (Importing(record.state) && record.imported == layers_ && !record.busy) {
      copying.push_back(id);
    }
  }
  bool pending = false;
  for (serving::RequestId id : copying) {
    auto it = records_.find(id);
    if (it == records_.end() || !Importing(it->second.state) || it->second.busy) continue;
    it->second.busy = true;
    mu_.Unlock();
    const absl::StatusOr<bool> copied = slots_->Copied(id);
    mu_.Lock();
    it = records_.find(id);
    if (it->second.state == State::kCancelled) {
      AfterCall(id);
      continue;
    }
    if (!copied.ok() || !it->second.fault.ok()) {
      Fail(id, copied.ok() ? it->second.fault : copied.status());
      continue;
    }
    it->second.busy = false;
    if (*copied) {
      Apply(id, it->second, Event::kAllCopied);
    } else {
      pending = true;
    }
  }
  return pending;
}

void EarlyImporter::Run() {
  absl::MutexLock lock(&mu_);
  auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopping_ || !queue_.empty()) return true;
    for (const auto& [id, record] : records_) {
      if (Importing(record.state) && record.imported == layers_ && !record.busy) return true;
    }
    return false;
  };
  while (!stopping_) {
    const bool copies_pending = Work();
    if (!queue_.empty()) continue;
    if (copies_pending) {
      // Copies in flight: look again shortly (an event query, no waiting on the device).
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](bool* s) { return *s; }, &stopping_),
                           absl::Microseconds(50));
      continue;
    }
    mu_.Await(absl::Condition(&wake));
  }
}

void ModelLock::LockForImport() {
  ++importers_waiting_;
  mu_.Lock();
  --importers_waiting_;
}

void ModelLock::LockForStep() {
  while (importers_waiting_.load() > 0) std::this_thread::yield();
  mu_.Lock();
}

void ModelLock::Unlock() { mu_.Unlock(); }

}  // namespace pdserve::runtime
