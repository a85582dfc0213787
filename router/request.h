// The state of one RouterService request and of each try of its choices: internal to router/
// (service.cc is the service front, dispatch.cc drives the workers, request.cc the request's own
// bookkeeping). Not part of the router's API.
//
// Thread-safety: a Request's fields marked ABSL_GUARDED_BY(mu) and an Attempt's fields below its
// "Guarded by Request::mu" line are touched only under the owning Request's mu; the rest are
// set before the request or attempt is shared, or atomic.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "frontend/api_response.h"
#include "frontend/generation_service.h"
#include "frontend/request_preparer.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"
#include "router/lifecycle.h"
#include "router/service.h"
#include "router/worker_pool.h"

namespace pdserve::router {

namespace wv1 = worker::v1;

// The gRPC deadline `timeout` from now.
inline std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
}

// A status that means the worker is down or stopped (retried on another worker).
inline bool WorkerDown(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// A worker call's status as the router acts on it. A CANCELLED the router did not ask for
// (`cancelled_by_router` false) and without error details came from the worker's server, which
// refuses every call from the moment it begins to drain (common/grpc_listener.h); a call that
// crossed its GOAWAY ends so. It reads as UNAVAILABLE: the worker is going down, and the call is
// retried like one to a worker that is down. Every other status is returned as it is, also a
// CANCELLED with details: the worker's own handler marked it (worker/transfer_peer.h: a prefill
// whose pages the decode worker refused; a 500 with its message, counted against no worker).
inline grpc::Status RefusedByDrainAsDown(const grpc::Status& status, bool cancelled_by_router) {
  if (status.error_code() != grpc::StatusCode::CANCELLED || cancelled_by_router ||
      !status.error_details().empty()) {
    return status;
  }
  return grpc::Status(
      grpc::StatusCode::UNAVAILABLE,
      "the worker cancelled the call (it began to shut down): " + status.error_message());
}

// A Generate that ended NOT_FOUND before any event (`got_event` false): the decode worker on
// that port does not know the reservation (Generate's only NOT_FOUND, docs/protocol.md). The
// process that granted it is gone: a replacement took the port of one that began to drain (or
// crashed) between the Reserve and the Generate. Retried like a worker that is down, before the
// first token and within max_attempts, but not counted against the worker: the process that
// answered works.
inline bool ReservationLost(const grpc::Status& status, bool got_event) {
  return status.error_code() == grpc::StatusCode::NOT_FOUND && !got_event;
}

// A status that may stand for a call the worker ran although its answer never arrived (past the
// deadline, cancelled, connection lost): a Reserve with such a status may hold pages there.
inline bool AnswerLost(grpc::StatusCode code) {
  return code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::CANCELLED ||
         code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::UNKNOWN;
}

// Runs and clears `actions` (call with no Request lock held).
void RunActions(Actions& actions);

// One try of a request's choices on one (prefill, decode) pair. All n choices of a request share
// one Reserve (SamplingParams.choice_count = n), one Prefill and one transfer: the attempt of
// choice 0 (the lead) sends them; once reserved, each other choice k gets a member attempt
// streaming worker request request_id + k (the decode worker's fork k) from the same ticket.
// The lead's Reserve and Prefill outcomes are the group's: a retry or failure covers every
// choice. Fields below `mu`-comments are guarded by the owning Request's mu.
struct RouterService::Attempt : std::enable_shared_from_this<Attempt> {
  int choice = 0;
  // The lead: how many choices the group covers (n); a member: 0 (it sends no Reserve or
  // Prefill and holds no prefill load).
  int count = 1;
  // A member's lead (null for the lead itself).
  std::shared_ptr<Attempt> lead;
  int prefill_index = -1;
  int decode_index = -1;
  Worker* prefill = nullptr;
  Worker* decode = nullptr;
  uint64_t request_id = 0;
  uint64_t ticket_id = 0;
  grpc::ClientContext reserve_context;
  grpc::ClientContext prefill_context;
  grpc::ClientContext generate_context;
  wv1::ReserveRequest reserve;
  wv1::ReserveResponse reserved;
  wv1::PrefillRequest prefill_request;
  wv1::PrefillResponse prefilled;
  wv1::GenerateRequest generate;
  // Dispatched from the admission queue: its Reserve's outcome is the queue's try
  // (AdmissionQueue::Admitted / PushBack). Set before the attempt is shared.
  bool from_queue = false;
  // Guarded by Request::mu.
  // The lead's members, choices 1 .. count - 1 (set once reserved).
  std::vector<std::weak_ptr<Attempt>> members;
  // The lead's abort covered every fork of the reservation (AbortRequest.choice_count): its
  // members send no Abort of their own.
  bool group_aborted = false;
  // Changed only by Request::Move (router/lifecycle.h).
  AttemptState state = AttemptState::kReserving;
  bool over() const { return AttemptOver(state); }
  // The first token's logprobs come from the Prefill answer (PrefillResponse.first_token), not
  // from Generate's first event. When logprobs are requested, Generate's events (and its end)
  // are held here until Prefill has answered (kPrefilled), then replayed in order.
  bool first_event_handled = false;
  std::deque<wv1::GenerateResponse> held;
  std::optional<grpc::Status> held_done;
  // Set from other threads without Request::mu (the health checker, the stream reactors):
  // The last Generate event's (or the stream start's) time, absl::ToUnixNanos; and whether the
  // stream was cancelled because its worker is down and it stalled (CancelStalledStreams).
  std::atomic<int64_t> last_event_ns{0};
  std::atomic<bool> stalled_on_down{false};
  // The Prefill call is out (sent, not answered); a Generate event arrived; the Prefill was
  // cancelled because the health checker marked its worker down (CancelPrefillsOn).
  std::atomic<bool> prefill_pending{false};
  std::atomic<bool> got_event{false};
  std::atomic<bool> prefill_on_down{false};
};

// One choice of a request (API `n`), guarded by its Request's mu.
struct RouterService::Choice {
  explicit Choice(frontend::ChoiceText choice_text) : text(std::move(choice_text)) {}
  frontend::ChoiceText text;
  // Changed only by Request::Move (router/lifecycle.h).
  ChoiceState state = ChoiceState::kTrying;
  int attempts = 0;  // tries counted against max_attempts
  std::shared_ptr<Attempt> current;
  // The degeneration kind once the detector flagged it (GenerateResponse.degeneration_kind,
  // "unknown" when the worker sent none); empty: not flagged.
  std::string degeneration;
  // Admission: the decode workers that answered "no room" since the choice last left the queue
  // (not asked again before it waits); when it first found every one full (its wait starts;
  // reset once it holds a reservation); its queue ticket (kept while it is being tried, so a try
  // that finds no room keeps its place); whether it ever held a reservation.
  std::vector<int> full_decode;
  // The prefill worker that could not be reached for this choice's last prefill (UNAVAILABLE):
  // Dispatch avoids it (with a queue, the retry waits for room on a full one rather than go back
  // to it), also on the tries a full decode worker or the queue makes, until the choice holds a
  // reservation. -1: none.
  int failed_prefill = -1;
  std::optional<absl::Time> queued_since;
  uint64_t queue_ticket = 0;
  bool reserved_once = false;
  // A token of it reached the client: it is never retried.
  bool any_token() const { return state == ChoiceState::kStreaming || state == ChoiceState::kDone; }
};

struct RouterService::Request : std::enable_shared_from_this<Request> {
  RouterService* service = nullptr;
  frontend::ApiRequest api;
  frontend::PreparedRequest prepared;
  std::shared_ptr<frontend::GenerationSink> sink;
  std::string endpoint;
  absl::Time received;
  std::atomic<bool> cancelled{false};

  absl::Mutex mu;
  std::vector<Choice> choices ABSL_GUARDED_BY(mu);
  int remaining ABSL_GUARDED_BY(mu) = 0;
  bool ended ABSL_GUARDED_BY(mu) = false;  // the sink got OnComplete or OnError
  bool dispatched ABSL_GUARDED_BY(mu) = false;
  std::optional<absl::Time> first_token ABSL_GUARDED_BY(mu);
  absl::Time last_token ABSL_GUARDED_BY(mu);
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;
  int reserved_choices ABSL_GUARDED_BY(mu) = 0;  // choices that held a reservation once
  std::string full_detail ABSL_GUARDED_BY(mu);   // the last "no room" answer, for the 429
  // What the request last waited for: true, a prefill worker under the router's
  // max_prefills_per_worker (429 prefill_busy); false, decode room (429 pool_exhausted).
  bool waits_for_prefill ABSL_GUARDED_BY(mu) = false;

  // Moves choice `choice` (or `attempt`) on by `event` (router/lifecycle.h). An illegal event
  // is a bug: logged as an error, and the request fails with a 500. Returns whether it was legal.
  bool Move(int choice, ChoiceEvent event, Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  bool Move(Attempt& attempt, AttemptEvent event, Actions* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Aborts `attempt` on both workers and cancels its calls (run the actions after unlocking).
  // `whole_group`: the request's every choice ends; a lead's Abort then covers all the forks of
  // its reservation (and its members send none), else it covers its own fork alone. A member
  // aborts only its own fork on the decode worker (the prefill is the lead's).
  void AbortAttempt(Attempt& attempt, Actions* actions, bool whole_group = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Aborts every choice's running attempt, the lead's reservation as a whole.
  void AbortAll(Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The attempts of `lead`'s group still referenced: the lead, then its members in order.
  std::vector<std::shared_ptr<Attempt>> Group(Attempt& lead) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Ends the request with `error`, takes its choices out of the admission queue and aborts every
  // choice still running.
  void Fail(frontend::ApiError error, Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Takes every choice waiting in the admission queue out of it, ends the wait of every choice
  // that has not held a reservation since it queued (waiting, or being tried now), counting it
  // with `outcome` (pdserve_router_queue_wait_seconds), and ends every unfinished choice.
  void Unqueue(const char* outcome, Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Ends choice `choice`'s wait (if it waited), counting it with `outcome`.
  void EndWait(int choice, const char* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Sends `delta` for a choice, with the token timing metrics; a flagged choice's deltas carry
  // its degeneration kind.
  void Emit(frontend::ChoiceDelta delta, int new_tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Moves every choice but choice 0 (whose move the caller made) by `event`: the group's other
  // choices queue and leave the queue with it.
  void MoveOthers(ChoiceEvent event, Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Marks `attempt`'s choice finished; the last one completes the request (OnComplete).
  void ChoiceDone(Attempt& attempt, Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

}  // namespace pdserve::router
