// RouterService's admission: the admission queue's side of dispatch. A choice that finds every
// decode worker full, or every prefill worker holding options.max_prefills_per_worker of this
// router's requests, waits in the queue (router/admission_queue.h) and is dispatched again on
// its try; past options.queue_timeout it fails with 429 (docs/architecture.md, "Admission").
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "router/request.h"
#include "router/service.h"

namespace pdserve::router {

bool RouterService::PrefillFull(std::vector<Candidate>* candidates) const {
  const int64_t cap = options_.max_prefills_per_worker;
  if (cap <= 0) return false;
  bool any_up = false;
  bool any_room = false;
  for (Candidate& c : *candidates) {
    if (!c.up) continue;
    any_up = true;
    if (c.load >= cap) {
      c.up = false;  // not picked: it holds its share
    } else {
      any_room = true;
    }
  }
  return any_up && !any_room;
}

bool RouterService::DecodeLeftToAsk(Request& request, int choice) const {
  const std::vector<Worker*> decode = pool_->decode();
  const std::vector<int>& full = request.choices[static_cast<size_t>(choice)].full_decode;
  for (size_t i = 0; i < decode.size(); ++i) {
    if (decode[i]->up() && std::find(full.begin(), full.end(), static_cast<int>(i)) == full.end()) {
      return true;
    }
  }
  return false;
}

bool RouterService::FullDecodeUp(Request& request, int choice) const {
  const std::vector<Worker*> decode = pool_->decode();
  for (int full : request.choices[static_cast<size_t>(choice)].full_decode) {
    if (decode[static_cast<size_t>(full)]->up()) return true;
  }
  return false;
}

std::string RouterService::FailedPrefillDetail(const Choice& choice) const {
  const std::vector<Worker*> prefill = pool_->prefill();
  if (choice.failed_prefill < 0 || choice.failed_prefill >= static_cast<int>(prefill.size())) {
    return "";
  }
  return absl::StrCat(" after prefill worker ", prefill[choice.failed_prefill]->name(),
                      " failed it");
}

void RouterService::Enqueue(Request& request, int choice, Actions* actions) {
  Choice& c = request.choices[static_cast<size_t>(choice)];
  const std::string detail =
      request.full_detail.empty() ? std::string() : absl::StrCat(" (", request.full_detail, ")");
  if (queue_ == nullptr) {  // router.queue_timeout_ms 0: nothing waits, so nothing is queued
    request.Fail(
        request.waits_for_prefill
            ? frontend::ServerError(
                  429,
                  absl::StrCat("every prefill worker is busy (", options_.max_prefills_per_worker,
                               " requests each, router.max_prefills_per_worker); retry later"),
                  "rate_limit_exceeded", "prefill_busy")
            : frontend::ServerError(
                  429, absl::StrCat("every decode worker is full; retry later", detail),
                  "rate_limit_exceeded", "pool_exhausted"),
        actions);
    return;
  }
  const absl::Time now = absl::Now();
  if (!c.queued_since) {
    c.queued_since = now;
    queued_->Get().Increment();
  }
  const absl::Time deadline = *c.queued_since + options_.queue_timeout;
  if (now >= deadline) {
    request.EndWait(choice, "timeout");
    const int64_t wait_ms = absl::ToInt64Milliseconds(options_.queue_timeout);
    request.Fail(
        request.waits_for_prefill
            ? frontend::ServerError(
                  429,
                  absl::StrCat("every prefill worker stayed busy (",
                               options_.max_prefills_per_worker,
                               " requests each, router.max_prefills_per_worker) for the ", wait_ms,
                               " ms the request may wait (router.queue_timeout_ms)",
                               FailedPrefillDetail(c), "; retry later"),
                  "rate_limit_exceeded", "prefill_busy")
            : frontend::ServerError(
                  429,
                  absl::StrCat("every decode worker stayed full for the ", wait_ms,
                               " ms the request may wait (router.queue_timeout_ms); retry later",
                               detail),
                  "rate_limit_exceeded", "pool_exhausted"),
        actions);
    return;
  }
  std::shared_ptr<Request> r = request.shared_from_this();
  AdmissionQueue::Entry entry;
  entry.deadline = deadline;
  entry.admit = [this, r, choice] { return Admit(r, choice); };
  entry.expire = [this, r, choice] { Expire(r, choice); };
  if (!request.Move(choice, ChoiceEvent::kQueue, actions)) return;
  request.MoveOthers(ChoiceEvent::kQueue, actions);  // the group waits as one
  if (c.queue_ticket != 0) {
    queue_->PushBack(c.queue_ticket, std::move(entry));  // keeps its place
  } else {
    c.queue_ticket = queue_->Push(std::move(entry));
  }
}

bool RouterService::Admit(const std::shared_ptr<Request>& request, int choice) {
  Actions actions;
  bool dispatch = false;
  {
    absl::MutexLock lock(&request->mu);
    dispatch = request->Move(choice, ChoiceEvent::kLeaveQueue, &actions) && !request->ended &&
               !request->cancelled.load();
    if (dispatch) request->MoveOthers(ChoiceEvent::kLeaveQueue, &actions);
    // A new round: ask them all (Dispatch still avoids an unreachable prefill worker).
    if (dispatch) request->choices[static_cast<size_t>(choice)].full_decode.clear();
  }
  RunActions(actions);
  return dispatch && Dispatch(request, choice, -1, -1, /*from_queue=*/true);
}

void RouterService::Expire(const std::shared_ptr<Request>& request, int choice) {
  Actions actions;
  {
    absl::MutexLock lock(&request->mu);
    if (request->Move(choice, ChoiceEvent::kLeaveQueue, &actions) && !request->ended &&
        !request->cancelled.load()) {
      request->MoveOthers(ChoiceEvent::kLeaveQueue, &actions);
      Enqueue(*request, choice, &actions);  // past its deadline: fails with 429
    }
  }
  RunActions(actions);
}

}  // namespace pdserve::router
