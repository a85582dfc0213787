// The router's admission queue: choices that found every decode worker full (Reserve answered
// RESOURCE_EXHAUSTED: no batch slot or no state pages) wait here for room, first come first
// served, each up to its own deadline (router.queue_timeout_ms).
//
// Room is signalled, not polled for. RoomFreed() (a decode reservation of this router ended)
// gives the head of the queue one try at once; a try that found room (Admitted()) gives the next
// entry a try too, since room may be left. A try that found none puts its entry back in its old
// place (PushBack: the order is by first arrival, so a retried entry never loses its turn), and
// the next try nobody signalled waits a backoff, min_backoff doubling up to max_backoff, so room
// that frees where the router cannot see it (an abort fence, a lease, another router's requests)
// is still found without a busy loop. An entry past its deadline is taken out and its expire
// callback runs (the router answers 429 with Retry-After).
//
// Thread-safety: every method is thread-safe. The queue's own thread runs the admit and expire
// callbacks, never with the queue's lock held, so they may call back into the queue; the lock
// is a leaf (callers may hold their own locks when they call in).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::router {

class AdmissionQueue {
 public:
  struct Options {
    absl::Duration min_backoff = absl::Milliseconds(5);
    absl::Duration max_backoff = absl::Milliseconds(100);
  };
  struct Entry {
    absl::Time deadline = absl::InfiniteFuture();
    // One try: dispatch the choice again. Returns false when nothing was sent (the request is
    // gone); the queue then moves on at once. The try's outcome comes back as Admitted() or
    // PushBack().
    std::function<bool()> admit;
    // The deadline passed while the entry waited; it is no longer in the queue.
    std::function<void()> expire;
  };

  explicit AdmissionQueue(Options options);
  // Stop().
  ~AdmissionQueue();
  AdmissionQueue(const AdmissionQueue&) = delete;
  AdmissionQueue& operator=(const AdmissionQueue&) = delete;

  // Queues `entry` behind every entry queued before it; returns its ticket (> 0), which keeps
  // its place for PushBack and names it for Remove.
  uint64_t Push(Entry entry) ABSL_LOCKS_EXCLUDED(mu_);
  // Puts back an entry whose try found no room, in its old place (ticket order), and backs off
  // the next unsignalled try.
  void PushBack(uint64_t ticket, Entry entry) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes a waiting entry out (its request is gone); no callback runs. False when it is not
  // waiting (being tried, expired or never queued).
  bool Remove(uint64_t ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // A decode reservation ended: the head gets a try now.
  void RoomFreed() ABSL_LOCKS_EXCLUDED(mu_);
  // A try found room: the backoff resets and the next entry gets a try.
  void Admitted() ABSL_LOCKS_EXCLUDED(mu_);
  // Entries waiting (not counting one being tried).
  int64_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the thread once a callback running now returns; no callback runs after it, and
  // entries still waiting (or pushed later) are dropped without one. Idempotent (one caller at
  // a time: the owner's destructor).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // Gives the head a try when one is owed (a signal) or the backoff has passed.
  bool TryDue(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> waiting_ ABSL_GUARDED_BY(mu_);  // by ticket: arrival order
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t tries_owed_ ABSL_GUARDED_BY(mu_) = 0;  // signalled tries (RoomFreed, Admitted)
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_);
  absl::Time next_try_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // unsignalled try
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pdserve::router
