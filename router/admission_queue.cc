#include "router/admission_queue.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

namespace pdserve::router {

AdmissionQueue::AdmissionQueue(Options options) : options_(options), backoff_(options.min_backoff) {
  thread_ = std::thread([this] { Loop(); });
}

AdmissionQueue::~AdmissionQueue() { Stop(); }

void AdmissionQueue::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

uint64_t AdmissionQueue::Push(Entry entry) {
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = next_ticket_++;
  // The entry's own try just found no room: the first unsignalled try waits a backoff.
  if (waiting_.empty()) next_try_ = std::max(next_try_, absl::Now() + backoff_);
  waiting_.emplace(ticket, std::move(entry));
  changed_ = true;
  return ticket;
}

void AdmissionQueue::PushBack(uint64_t ticket, Entry entry) {
  absl::MutexLock lock(&mu_);
  waiting_.emplace(ticket, std::move(entry));
  backoff_ = std::min(backoff_ * 2, options_.max_backoff);
  next_try_ = absl::Now() + backoff_;
  changed_ = true;
}

bool AdmissionQueue::Remove(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  if (waiting_.erase(ticket) == 0) return false;
  tries_owed_ = std::min<int64_t>(tries_owed_, static_cast<int64_t>(waiting_.size()));
  changed_ = true;
  return true;
}

void AdmissionQueue::RoomFreed() {
  absl::MutexLock lock(&mu_);
  if (waiting_.empty()) return;
  tries_owed_ = std::min<int64_t>(tries_owed_ + 1, static_cast<int64_t>(waiting_.size()));
  changed_ = true;
}

void AdmissionQueue::Admitted() {
  absl::MutexLock lock(&mu_);
  backoff_ = options_.min_backoff;
  if (waiting_.empty()) return;
  tries_owed_ = std::min<int64_t>(tries_owed_ + 1, static_cast<int64_t>(waiting_.size()));
  changed_ = true;
}

int64_t AdmissionQueue::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(waiting_.size());
}

bool AdmissionQueue::TryDue(absl::Time now) const {
  return !waiting_.empty() && (tries_owed_ > 0 || now >= next_try_);
}

void AdmissionQueue::Loop() {
  mu_.Lock();
  while (!stop_) {
    const absl::Time now = absl::Now();
    std::vector<Entry> expired;
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(std::move(it->second));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    std::optional<Entry> head;
    if (TryDue(now)) {
      if (tries_owed_ > 0) --tries_owed_;
      next_try_ = now + backoff_;
      head = std::move(waiting_.begin()->second);
      waiting_.erase(waiting_.begin());
    }
    tries_owed_ = std::min<int64_t>(tries_owed_, static_cast<int64_t>(waiting_.size()));
    if (!expired.empty() || head) {
      mu_.Unlock();
      for (Entry& entry : expired) entry.expire();
      const bool sent = head && head->admit();
      mu_.Lock();
      // A try for a request that is gone used nothing: the next entry gets it.
      if (head && !sent && !waiting_.empty()) ++tries_owed_;
      continue;
    }
    changed_ = false;
    absl::Time wake = absl::InfiniteFuture();
    if (!waiting_.empty()) {
      wake = next_try_;
      for (const auto& [ticket, entry] : waiting_) wake = std::min(wake, entry.deadline);
    }
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || changed_; };
    mu_.AwaitWithDeadline(absl::Condition(&woken), wake);
  }
  mu_.Unlock();
}

}  // namespace pdserve::router
