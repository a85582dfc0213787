// RouterService's worker side: picking workers, Reserve and Prefill per request (its choices as
// one group, router/group.cc), Generate per choice, their answers, retries, aborts and the
// stalled-stream canceller (the front is service.cc).
#include <algorithm>
#include <functional>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "router/convert.h"
#include "router/request.h"
#include "router/service.h"
#include "spdlog/spdlog.h"
#include "worker/transfer_peer.h"

namespace pdserve::router {
namespace {

// The API error for a failed Reserve (RESOURCE_EXHAUSTED is admission's: Enqueue).
// FAILED_PRECONDITION is the client's to change: n when the decode worker says the n choices of a
// shared reservation can never fit (its message then starts "n = ", docs/protocol.md), else
// max_tokens.
frontend::ApiError ReserveError(const grpc::Status& status, const std::string& worker) {
  const std::string detail = absl::StrCat("decode worker ", worker, ": ", status.error_message());
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      return frontend::InvalidRequest(detail);
    case grpc::StatusCode::FAILED_PRECONDITION:
      // It can never fit that worker (prompt + max_tokens, or n): the client's to change.
      return frontend::InvalidRequest(
          detail, absl::StartsWith(status.error_message(), "n = ") ? "n" : "max_tokens");
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return frontend::ServerError(
          503, absl::StrCat("no decode worker could take the request (", detail, ")"),
          "server_error", "worker_unavailable");
    default:
      return frontend::ServerError(500, detail, "server_error");
  }
}

// A failed Prefill whose transfer to the decode worker failed, as the prefill worker marks it
// (worker/transfer_peer.h): the decode worker's failure, not the prefill worker's.
bool TransferPeerFailed(const grpc::Status& status) {
  return WorkerDown(status.error_code()) && status.error_details() == worker::kTransferPeerFailed;
}

// A Prefill refused because the decode worker's ticket does not fit the prefill worker's model
// (worker/transfer_peer.h): that pair cannot work; another decode worker may.
bool TicketMismatch(const grpc::Status& status) {
  return status.error_details() == worker::kTicketMismatch;
}

// The API error for a failed Prefill (see OnPrefilled for the retries before it).
frontend::ApiError PrefillError(const grpc::Status& status, const std::string& worker,
                                const std::string& decode_worker) {
  const std::string detail = absl::StrCat("prefill worker ", worker, ": ", status.error_message());
  if (TicketMismatch(status)) {
    // Configuration, not a transient failure: the two workers disagree on what the state is or
    // how it travels (docs/operations.md, "Model identity").
    return frontend::ServerError(
        503,
        absl::StrCat("prefill worker ", worker, " refused the ticket of decode worker ",
                     decode_worker, ": ", status.error_message()),
        "server_error", "workers_incompatible");
  }
  if (TransferPeerFailed(status)) {
    return frontend::ServerError(503,
                                 absl::StrCat("the state transfer to decode worker ", decode_worker,
                                              " failed (", detail, ")"),
                                 "server_error", "worker_unavailable");
  }
  switch (status.error_code()) {
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return frontend::ServerError(
          429, absl::StrCat("the prefill workers are busy; retry later (", detail, ")"),
          "rate_limit_exceeded", "prefill_busy");
    case grpc::StatusCode::UNAVAILABLE:
      return frontend::ServerError(
          503, absl::StrCat("no prefill worker could take the request (", detail, ")"),
          "server_error", "worker_unavailable");
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return frontend::ServerError(
          503, absl::StrCat("prefill worker ", worker, " did not answer in time (", detail, ")"),
          "server_error", "prefill_timeout");
    default:
      return frontend::ServerError(500, detail, "server_error", "prefill_failed");
  }
}

// A final event that ends the choice normally (not an abort or error).
bool NormalEnd(const std::string& finish) {
  return finish == "stop" || finish == "length" || finish == "degenerate";
}

frontend::SampledText SampledFrom(const wv1::SampledToken& token) {
  frontend::SampledText sampled;
  sampled.token = token.token_id();
  sampled.logprob = token.logprob();
  for (const wv1::TokenLogprob& top : token.top_logprobs()) {
    sampled.top.emplace_back(top.token_id(), top.logprob());
  }
  return sampled;
}

// Token `i` of a Generate event: with its logprobs when the event has them, else the id alone.
frontend::SampledText SampledAt(const wv1::GenerateResponse& event, int i) {
  if (i < event.tokens_size()) return SampledFrom(event.tokens(i));
  frontend::SampledText sampled;
  sampled.token = event.token_ids(i);
  return sampled;
}

// The Generate stream of one attempt; deletes itself when the call is done.
class GenerateReader : public grpc::ClientReadReactor<wv1::GenerateResponse> {
 public:
  using Request = RouterService::Request;
  using Attempt = RouterService::Attempt;
  GenerateReader(std::shared_ptr<Request> request, std::shared_ptr<Attempt> attempt,
                 std::function<void(Request&, Attempt&, const wv1::GenerateResponse&)> on_event,
                 std::function<void(Request&, Attempt&, const grpc::Status&)> on_done)
      : request_(std::move(request)),
        attempt_(std::move(attempt)),
        on_event_(std::move(on_event)),
        on_done_(std::move(on_done)) {}

  void Start() {
    attempt_->decode->decode()->async()->Generate(&attempt_->generate_context, &attempt_->generate,
                                                  this);
    StartRead(&event_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    on_event_(*request_, *attempt_, event_);
    event_.Clear();
    StartRead(&event_);
  }
  void OnDone(const grpc::Status& status) override {
    on_done_(*request_, *attempt_, status);
    delete this;
  }

 private:
  std::shared_ptr<Request> request_;
  std::shared_ptr<Attempt> attempt_;
  std::function<void(Request&, Attempt&, const wv1::GenerateResponse&)> on_event_;
  std::function<void(Request&, Attempt&, const grpc::Status&)> on_done_;
  wv1::GenerateResponse event_;
};

}  // namespace

bool RouterService::Dispatch(const std::shared_ptr<Request>& request, int choice,
                             int exclude_prefill, int exclude_decode, bool from_queue) {
  if (request->cancelled.load()) return false;
  const std::vector<Worker*> prefill = pool_->prefill();
  const std::vector<Worker*> decode = pool_->decode();
  auto candidates = [](const std::vector<Worker*>& workers) {
    std::vector<Candidate> out;
    for (const Worker* w : workers) out.push_back({w->up(), w->load()});
    return out;
  };
  std::vector<Candidate> p_candidates = candidates(prefill);
  std::vector<Candidate> d_candidates = candidates(decode);
  bool full_one_up = false;           // a decode worker that is up said "no room" for this choice
  bool unreachable_excluded = false;  // exclude_prefill is a worker that could not be reached
  {
    absl::MutexLock lock(&request->mu);
    Choice& c = request->choices[static_cast<size_t>(choice)];
    // A prefill worker that could not be reached (Choice::failed_prefill) is avoided until the
    // choice holds a reservation, also on the tries a full decode worker or the queue makes.
    if (exclude_prefill < 0) exclude_prefill = c.failed_prefill;
    unreachable_excluded = exclude_prefill >= 0 && exclude_prefill == c.failed_prefill;
    full_one_up = FullDecodeUp(*request, choice);
    // The workers that had no room for this choice are not asked again before it waits.
    for (int full : c.full_decode) d_candidates[static_cast<size_t>(full)].up = false;
  }
  std::vector<bool> prefill_up;
  for (const Candidate& c : p_candidates) prefill_up.push_back(c.up);
  // Every prefill worker that is up holds max_prefills_per_worker of this router's requests:
  // the choice waits here, where no lease runs, rather than in a prefill worker's queue with
  // decode pages reserved.
  const bool prefill_full = PrefillFull(&p_candidates);
  // A prefill worker other than the unreachable one a retry avoids is up but holds its share:
  // with a queue, the retry waits for room there rather than go back to the unreachable one.
  bool full_prefill_up = false;
  for (size_t i = 0; i < p_candidates.size(); ++i) {
    if (static_cast<int>(i) != exclude_prefill && prefill_up[i] && !p_candidates[i].up) {
      full_prefill_up = true;
    }
  }
  const bool wait_for_full_prefill = unreachable_excluded && full_prefill_up && queue_ != nullptr;
  int p = prefill_policy_->Pick(p_candidates, request->prepared.prompt, exclude_prefill);
  int d = decode_policy_->Pick(d_candidates, request->prepared.prompt, exclude_decode);
  // A retry prefers another worker but takes the same one when it is the only one up; not when
  // it was unreachable and a full one is up (with a queue): the choice waits for room there.
  if (p < 0 && exclude_prefill >= 0 && !wait_for_full_prefill)
    p = prefill_policy_->Pick(p_candidates, request->prepared.prompt);
  if (d < 0 && exclude_decode >= 0 && !full_one_up)
    d = decode_policy_->Pick(d_candidates, request->prepared.prompt);
  Actions actions;
  bool queued = false;
  if (p < 0 || d < 0) {
    absl::MutexLock lock(&request->mu);
    if (p < 0 && (prefill_full || wait_for_full_prefill)) {
      request->waits_for_prefill = true;
      if (!request->ended) Enqueue(*request, choice, &actions);
      queued = !request->ended;
    } else if (p >= 0 && full_one_up) {
      // Every decode worker left to ask went down or failed this choice: it waits for room on
      // the full ones, as when all are full (before: 503 "no decode worker is up" while one was).
      request->waits_for_prefill = false;
      if (!request->ended) Enqueue(*request, choice, &actions);
      queued = !request->ended;
    } else {
      request->Fail(NoWorkerUpError(p < 0, p >= 0), &actions);
    }
  }
  if (!actions.empty() || p < 0 || d < 0) {
    RunActions(actions);
    // A queue's try that put the choice back is not "nothing sent": the queue then backs off
    // instead of giving the same entry another try at once.
    return queued;
  }
  auto attempt = std::make_shared<Attempt>();
  const int n = request->prepared.params.n;
  attempt->from_queue = from_queue;
  attempt->choice = choice;
  attempt->count = n;
  attempt->prefill_index = p;
  attempt->decode_index = d;
  attempt->prefill = prefill[p];
  attempt->decode = decode[d];
  // Fork k of the reservation streams as worker request request_id + k.
  attempt->request_id = NextRequestIds(n);
  wv1::SamplingParams sampling = ToProto(request->prepared.params, choice);
  if (n > 1) sampling.set_choice_count(static_cast<uint32_t>(n));  // absent: one choice
  attempt->reserve.set_request_id(attempt->request_id);
  attempt->reserve.set_prompt_tokens(static_cast<int32_t>(request->prepared.prompt.size()));
  for (int32_t t : request->prepared.prompt) attempt->reserve.add_prompt_token_ids(t);
  *attempt->reserve.mutable_sampling() = sampling;
  attempt->reserve.set_lease_ms(options_.lease_ms);
  SetPrefillCudaIpc(*attempt->prefill, &attempt->reserve);
  attempt->reserve_context.set_deadline(Deadline(options_.reserve_timeout));
  {
    absl::MutexLock lock(&request->mu);
    if (request->ended) return false;
    Choice& c = request->choices[static_cast<size_t>(choice)];
    ++c.attempts;
    c.current = attempt;
  }
  attempt->prefill->AddLoad(1);
  attempt->decode->AddLoad(n);
  in_flight_.fetch_add(n);
  std::shared_ptr<Request> r = request;
  attempt->decode->decode()->async()->Reserve(
      &attempt->reserve_context, &attempt->reserve, &attempt->reserved,
      [this, r, attempt](grpc::Status status) { OnReserved(r, attempt, status); });
  return true;
}

void RouterService::SendAbortPrefillThenDecode(Worker& prefill, Worker& decode, uint64_t request_id,
                                               uint64_t ticket_id, uint32_t forks) {
  Worker* d = &decode;
  SendAbort(prefill, request_id, ticket_id, /*prefill_quiesced=*/false,
            [this, d, request_id, ticket_id, forks](bool quiesced) {
              SendAbort(*d, request_id, ticket_id, quiesced, nullptr, forks);
            });
}

void RouterService::SendAbort(Worker& worker, uint64_t request_id, uint64_t ticket_id,
                              bool prefill_quiesced, std::function<void(bool quiesced)> then,
                              uint32_t forks) {
  struct Call {
    grpc::ClientContext context;
    wv1::AbortRequest request;
    wv1::AbortResponse response;
  };
  auto call = std::make_shared<Call>();
  // A prefill worker answers within 5 s (it waits that long at most for the prefill to stop).
  call->context.set_deadline(
      Deadline(worker.role() == Role::kDecode ? absl::Seconds(5) : absl::Seconds(6)));
  call->request.set_request_id(request_id);
  call->request.set_ticket_id(ticket_id);
  if (worker.role() == Role::kDecode) {
    call->request.set_prefill_quiesced(prefill_quiesced);
    if (forks > 1) call->request.set_choice_count(forks);
  }
  calls_.fetch_add(1);
  auto done = [this, call, then = std::move(then)](const grpc::Status& status) {
    if (then) then(status.ok() && call->response.quiesced());
    calls_.fetch_sub(1);
  };
  if (worker.role() == Role::kDecode) {
    worker.decode()->async()->Abort(&call->context, &call->request, &call->response,
                                    std::move(done));
  } else {
    worker.prefill()->async()->Abort(&call->context, &call->request, &call->response,
                                     std::move(done));
  }
}

void RouterService::ReleaseAttempt(Attempt& attempt, bool prefill, bool decode, bool reserved,
                                   int decode_units) {
  if (prefill) attempt.prefill->AddLoad(-1);
  if (decode) {
    attempt.decode->AddLoad(-decode_units);
    in_flight_.fetch_sub(decode_units);
    // Its batch slot frees (an abort lands shortly after): a waiting choice gets a try.
    if (reserved && queue_ != nullptr) queue_->RoomFreed();
  }
}

void RouterService::OnReserved(const std::shared_ptr<Request>& request,
                               const std::shared_ptr<Attempt>& attempt,
                               const grpc::Status& status) {
  Actions actions;
  bool start = false;
  Retry retry;
  {
    absl::MutexLock lock(&request->mu);
    if (!status.ok()) {
      retry = ReserveFailed(*request, *attempt, status, &actions);
    } else {
      start = Reserved(*request, *attempt, &actions);
    }
  }
  RunActions(actions);
  if (retry.decode != -2) {
    Dispatch(request, attempt->choice, retry.prefill, retry.decode, retry.from_queue);
    return;
  }
  if (start) StartStreams(request, attempt);
}

RouterService::Retry RouterService::ReserveFailed(Request& request, Attempt& attempt,
                                                  const grpc::Status& reserve_status,
                                                  Actions* actions) {
  const grpc::Status status =
      RefusedByDrainAsDown(reserve_status, attempt.state == AttemptState::kAborted ||
                                               request.ended || request.cancelled.load());
  if (WorkerDown(status.error_code())) attempt.decode->RecordFailure();
  ReleaseAttempt(attempt, true, true, /*reserved=*/false, attempt.count);
  if (AnswerLost(status.error_code()) && attempt.state != AttemptState::kAborted) {
    // The answer was lost, not a refusal: the Reserve may have run (or still run) on the
    // worker and hold pages until its lease. No Prefill was sent for this attempt, so the
    // worker frees them at once (prefill_quiesced), and an Abort that overtakes the Reserve
    // makes it fail with ABORTED (docs/protocol.md).
    request.Move(attempt, AttemptEvent::kAbort, actions);
    actions->push_back([this, decode = attempt.decode, id = attempt.request_id,
                        forks = static_cast<uint32_t>(attempt.count)] {
      SendAbort(*decode, id, /*ticket_id=*/0, /*prefill_quiesced=*/true, nullptr, forks);
    });
  } else {
    request.Move(attempt, AttemptEvent::kEnd, actions);
  }
  const grpc::StatusCode code = status.error_code();
  const int c = attempt.choice;
  Choice& choice = request.choices[static_cast<size_t>(c)];
  Retry retry;
  if (request.ended || request.cancelled.load()) {
  } else if (code == grpc::StatusCode::RESOURCE_EXHAUSTED) {
    // No room there now (batch slots or state pages): no failed try. The other decode
    // workers are asked first; when all are full the choice waits for room.
    --choice.attempts;
    choice.full_decode.push_back(attempt.decode_index);
    request.waits_for_prefill = false;
    request.full_detail =
        absl::StrCat("decode worker ", attempt.decode->name(), ": ", status.error_message());
    if (DecodeLeftToAsk(request, c)) {
      retry = {-1, -1, attempt.from_queue};  // still the queue's try
    } else {
      Enqueue(request, c, actions);
    }
  } else if (WorkerDown(code) && choice.attempts < options_.max_attempts) {
    retries_->WithLabels({code == grpc::StatusCode::DEADLINE_EXCEEDED ? "timeout" : "worker_down"})
        .Increment();
    retry = {-1, attempt.decode_index, false};
  } else if (WorkerDown(code) && queue_ != nullptr && OtherDecodeUp(attempt)) {
    // Out of retries (the full worker it asked between them sent it back to this one), but
    // another decode worker is up: the choice, which has no token yet, waits for room there.
    Enqueue(request, c, actions);
  } else {
    request.Fail(ReserveError(status, attempt.decode->name()), actions);
  }
  return retry;
}

bool RouterService::Reserved(Request& request, Attempt& attempt, Actions* actions) {
  attempt.decode->RecordSuccess();
  attempt.ticket_id = attempt.reserved.ticket().ticket_id();
  Choice& c = request.choices[static_cast<size_t>(attempt.choice)];
  c.failed_prefill = -1;  // its prefill worker is chosen: a later retry may ask any one again
  // Room was found: the queue's next entry gets a try too (room may be left).
  if (attempt.from_queue && queue_ != nullptr) queue_->Admitted();
  request.EndWait(attempt.choice, "admitted");
  c.queue_ticket = 0;
  for (Choice& each : request.choices) {  // the reservation holds every choice of the group
    if (each.reserved_once) continue;
    each.reserved_once = true;
    if (++request.reserved_choices == static_cast<int>(request.choices.size())) {
      queue_time_->Get().Observe(absl::ToDoubleSeconds(absl::Now() - request.received));
    }
  }
  if (request.ended || request.cancelled.load() || attempt.over()) {
    ReleaseAttempt(attempt, true, true, true, attempt.count);
    request.Move(attempt, AttemptEvent::kEnd, actions);
    // No Prefill was sent for this attempt: nothing can write its pages.
    SendAbort(*attempt.decode, attempt.request_id, attempt.ticket_id,
              /*prefill_quiesced=*/true, nullptr, static_cast<uint32_t>(attempt.count));
    return false;
  }
  if (!request.Move(attempt, AttemptEvent::kReserved, actions)) return false;
  if (!AddMembers(request, attempt, actions)) return false;
  attempt.prefill_request.set_request_id(attempt.request_id);
  for (int32_t t : request.prepared.prompt) attempt.prefill_request.add_token_ids(t);
  *attempt.prefill_request.mutable_sampling() = attempt.reserve.sampling();
  *attempt.prefill_request.mutable_ticket() = attempt.reserved.ticket();
  attempt.generate.set_request_id(attempt.request_id);
  attempt.generate.set_ticket_id(attempt.ticket_id);
  return true;
}

void RouterService::StartStreams(const std::shared_ptr<Request>& request,
                                 const std::shared_ptr<Attempt>& attempt) {
  std::vector<std::shared_ptr<Attempt>> group;
  {
    absl::MutexLock lock(&request->mu);
    group = request->Group(*attempt);
  }
  {
    absl::MutexLock lock(&streams_mu_);
    if (streams_.size() >= 256) {
      std::erase_if(streams_, [](const std::weak_ptr<Attempt>& a) { return a.expired(); });
    }
    for (const std::shared_ptr<Attempt>& a : group) {
      a->last_event_ns.store(absl::ToUnixNanos(absl::Now()));
      streams_.push_back(a);
    }
  }
  std::shared_ptr<Request> r = request;
  calls_.fetch_add(1);
  attempt->prefill_context.set_deadline(Deadline(options_.prefill_timeout));
  attempt->prefill_pending.store(true);
  attempt->prefill->prefill()->async()->Prefill(&attempt->prefill_context,
                                                &attempt->prefill_request, &attempt->prefilled,
                                                [this, r, attempt](grpc::Status s) {
                                                  OnPrefilled(r, attempt, s);
                                                  calls_.fetch_sub(1);
                                                });
  for (const std::shared_ptr<Attempt>& a : group) {
    auto* reader = new GenerateReader(
        request, a,
        [this](Request& req, Attempt& at, const wv1::GenerateResponse& event) {
          OnGenerateEvent(req, at, event);
        },
        [this](Request& req, Attempt& at, const grpc::Status& s) { OnGenerateDone(req, at, s); });
    reader->Start();
  }
}

bool RouterService::OtherDecodeUp(const Attempt& attempt) const {
  for (const Worker* w : pool_->decode()) {
    if (w != attempt.decode && w->up()) return true;
  }
  return false;
}

bool RouterService::OtherPrefillUp(const Attempt& attempt) const {
  for (const Worker* w : pool_->prefill()) {
    if (w != attempt.prefill && w->up()) return true;
  }
  return false;
}

void RouterService::OnPrefilled(const std::shared_ptr<Request>& request,
                                const std::shared_ptr<Attempt>& attempt,
                                const grpc::Status& status) {
  Actions actions;
  bool retry = false;
  bool retry_decode = false;
  {
    absl::MutexLock lock(&request->mu);
    attempt->prefill_pending.store(false);
    ReleaseAttempt(*attempt, true, false);
    // A prefill slot of this router freed: a choice waiting for one gets a try.
    if (queue_ != nullptr && options_.max_prefills_per_worker > 0) queue_->RoomFreed();
    // Cancelled by CancelPrefillsOn: the worker was marked down while it prefilled.
    const bool on_down =
        attempt->prefill_on_down.load() && status.error_code() == grpc::StatusCode::CANCELLED;
    if (on_down && attempt->first_event_handled && !request->prepared.params.logprobs) {
      // Raced with the commit: the decode worker has the state and streams; nothing is missing.
      for (const std::shared_ptr<Attempt>& a : request->Group(*attempt)) {
        request->Move(*a, AttemptEvent::kPrefillAnswered, &actions);
      }
    } else if (status.ok()) {
      attempt->prefill->RecordSuccess();
      // The answer is every choice's of the group: each gets its first token's logprobs and
      // replays what its Generate stream sent meanwhile.
      for (const std::shared_ptr<Attempt>& a : request->Group(*attempt)) {
        PrefillAnswered(*request, *attempt, *a, &retry, &retry_decode, &actions);
      }
    } else if (!attempt->over()) {
      // RESOURCE_EXHAUSTED (its queue is full): tried on another prefill worker when one is up,
      // else 429; the worker is busy, not down. UNAVAILABLE / DEADLINE_EXCEEDED (down, stopped,
      // past prefill_timeout): counted against the worker, retried (on another one when one is
      // up), else 503. Anything else: 500 with the worker's message. A failure after a token
      // reached the client is an SSE error event. Every failure aborts the decode reservation.
      // A Prefill cancelled because its worker was marked down counts as UNAVAILABLE.
      const grpc::Status failure =
          on_down ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "the health checker marked the worker down while it prefilled")
                  : RefusedByDrainAsDown(status, request->ended || request->cancelled.load());
      const grpc::StatusCode code = failure.error_code();
      // The prefill ran but its transfer to the decode worker failed (that worker gone or
      // failing, worker/transfer_peer.h): counted against the decode worker and retried with
      // another one; the prefill worker is fine.
      // A ticket the prefill worker refused as not fitting its model: the decode worker serves
      // another model (the health checker marks it down at its next check); retried with
      // another decode worker meanwhile.
      const bool mismatch = TicketMismatch(failure);
      const bool decode_peer = TransferPeerFailed(failure) || mismatch;
      if (decode_peer) {
        attempt->decode->RecordFailure();
      } else if (WorkerDown(code)) {
        attempt->prefill->RecordFailure();
      }
      const bool busy = code == grpc::StatusCode::RESOURCE_EXHAUSTED;
      if ((WorkerDown(code) || mismatch || (busy && OtherPrefillUp(*attempt))) &&
          CanRetry(*request, *attempt)) {
        retries_
            ->WithLabels({code == grpc::StatusCode::DEADLINE_EXCEEDED
                              ? "timeout"
                              : (busy ? "prefill_busy" : "worker_down")})
            .Increment();
        request->AbortAll(&actions);  // the whole group goes again
        (decode_peer ? retry_decode : retry) = true;
        // Unreachable (connection refused or reset, or marked down while it prefilled): its
        // retry, and the tries after it, avoid it rather than come back while it is not yet
        // marked down. A timeout or a full queue there is not that: they may come back to it.
        if (!decode_peer && code == grpc::StatusCode::UNAVAILABLE) {
          request->choices[static_cast<size_t>(attempt->choice)].failed_prefill =
              attempt->prefill_index;
        }
      } else {
        request->Fail(PrefillError(failure, attempt->prefill->name(), attempt->decode->name()),
                      &actions);
      }
    }
  }
  RunActions(actions);
  if (retry) Dispatch(request, attempt->choice, attempt->prefill_index, -1);
  if (retry_decode) Dispatch(request, attempt->choice, -1, attempt->decode_index);
}

void RouterService::OnGenerateEvent(Request& request, Attempt& attempt,
                                    const wv1::GenerateResponse& event) {
  attempt.last_event_ns.store(absl::ToUnixNanos(absl::Now()));
  attempt.got_event.store(true);
  Actions actions;
  bool retry = false;
  {
    absl::MutexLock lock(&request.mu);
    if (attempt.over() || request.ended) return;
    if (request.prepared.params.logprobs && attempt.state != AttemptState::kPrefilled) {
      attempt.held.push_back(event);  // replayed by OnPrefilled
      return;
    }
    retry = HandleEvent(request, attempt, event, &actions);
  }
  RunActions(actions);
  if (retry) Dispatch(request.shared_from_this(), GroupChoice(attempt), attempt.prefill_index, -1);
}

bool RouterService::HandleEvent(Request& request, Attempt& attempt,
                                const wv1::GenerateResponse& event, Actions* actions) {
  const bool first_event = !attempt.first_event_handled;
  attempt.first_event_handled = true;
  NoteDegeneration(request, attempt, event);
  if (!EmitTokens(request, attempt, event, first_event, actions)) return false;
  return HandleFinish(request, attempt, event, actions);
}

void RouterService::NoteDegeneration(Request& request, const Attempt& attempt,
                                     const wv1::GenerateResponse& event) {
  Choice& choice = request.choices[static_cast<size_t>(attempt.choice)];
  if (!event.degenerate() || !choice.degeneration.empty()) return;
  // The kind the decode worker found; "unknown" from a worker that predates the field.
  choice.degeneration = event.degeneration_kind().empty() ? "unknown" : event.degeneration_kind();
  const char* action = event.finish_reason() == "degenerate" ? "stop" : "flag";
  degenerate_->WithLabels({choice.degeneration, action}).Increment();
  spdlog::warn("router: request {} choice {} is degenerate ({}, action {}) on decode worker {}",
               request.prepared.request_id, attempt.choice, choice.degeneration, action,
               attempt.decode->name());
}

bool RouterService::EmitTokens(Request& request, const Attempt& attempt,
                               const wv1::GenerateResponse& event, bool first_event,
                               Actions* actions) {
  const int c = attempt.choice;
  frontend::ChoiceText& text = request.choices[static_cast<size_t>(c)].text;
  const std::string& finish = event.finish_reason();
  const int n = std::max(event.token_ids_size(), event.tokens_size());
  for (int i = 0; i < n && !text.done(); ++i) {
    frontend::SampledText sampled = SampledAt(event, i);
    if (first_event && i == 0 && request.prepared.params.logprobs) {
      // Generate's first token carries only its id: the logprobs are the prefill worker's.
      const wv1::SampledToken& first = attempt.prefilled.first_token();
      if (!attempt.prefilled.has_first_token() || first.token_id() != sampled.token) {
        request.Fail(
            frontend::ServerError(
                500,
                absl::StrCat("prefill worker ", attempt.prefill->name(),
                             attempt.prefilled.has_first_token()
                                 ? absl::StrCat(" sampled first token ", first.token_id(),
                                                " but decode worker ", attempt.decode->name(),
                                                " streamed ", sampled.token)
                                 : " sent no first token logprobs"),
                "server_error", "first_token_mismatch"),
            actions);
        return false;
      }
      sampled = SampledFrom(first);
    }
    if (!request.Move(c, ChoiceEvent::kToken, actions)) return false;
    frontend::ChoiceDelta delta = text.Add(sampled, i + 1 == n && NormalEnd(finish) ? finish : "");
    request.Emit(std::move(delta), 1);
  }
  return true;
}

bool RouterService::HandleFinish(Request& request, Attempt& attempt,
                                 const wv1::GenerateResponse& event, Actions* actions_out) {
  Actions& actions = *actions_out;
  const int c = attempt.choice;
  Choice& choice = request.choices[static_cast<size_t>(c)];
  frontend::ChoiceText& text = choice.text;
  const std::string& finish = event.finish_reason();
  const bool normal_end = NormalEnd(finish);
  if (text.done()) {
    // Finished here: by the worker's final event or by a stop string (then the worker is
    // still generating and is told to stop).
    if (finish.empty()) request.AbortAttempt(attempt, &actions);
    request.ChoiceDone(attempt, &actions);
  } else if (normal_end) {
    request.Emit(text.Finish(finish), 0);
    request.ChoiceDone(attempt, &actions);
  } else if (finish == "abort") {
    request.Fail(
        frontend::ServerError(503,
                              absl::StrCat("decode worker ", attempt.decode->name(),
                                           " aborted the request: ", event.error_message()),
                              "server_error", "worker_aborted"),
        &actions);
  } else if (finish == "error" && event.isolation_error() == wv1::ISOLATION_ERROR_LEASE &&
             attempt.state != AttemptState::kPrefilled && !choice.any_token()) {
    // The transfer's lease ran out before the prefill worker answered: it stalled (stopped,
    // wedged), which is the prefill worker's failure, not an isolation error.
    attempt.prefill->RecordFailure();
    if (CanRetry(request, attempt)) {
      retries_->WithLabels({"timeout"}).Increment();
      request.AbortAll(&actions);
      return true;
    }
    request.Fail(frontend::ServerError(
                     503,
                     absl::StrCat("prefill worker ", attempt.prefill->name(),
                                  " stalled: the transfer lease ran out before it answered (",
                                  event.error_message(), ")"),
                     "server_error", "prefill_timeout"),
                 &actions);
  } else if (!finish.empty()) {
    request.Fail(
        frontend::ServerError(
            500,
            absl::StrCat("decode worker ", attempt.decode->name(), ": ",
                         finish == "error" ? "" : finish + ": ", event.error_message(),
                         event.isolation_error() != 0
                             ? absl::StrCat(" (isolation error ",
                                            wv1::IsolationError_Name(event.isolation_error()), ")")
                             : ""),
            "server_error", event.isolation_error() != 0 ? "isolation_error" : "worker_error"),
        &actions);
  }
  return false;
}

void RouterService::OnGenerateDone(Request& request, Attempt& attempt, const grpc::Status& status) {
  Actions actions;
  bool retry = false;
  {
    absl::MutexLock lock(&request.mu);
    ReleaseAttempt(attempt, false, true);
    if (status.ok() && !attempt.held.empty() && !attempt.over() && !request.ended) {
      attempt.held_done = status;  // after the held events, when Prefill answers
    } else {
      retry = HandleDone(request, attempt, status, &actions);
    }
  }
  RunActions(actions);
  if (retry) Dispatch(request.shared_from_this(), GroupChoice(attempt), -1, attempt.decode_index);
}

bool RouterService::HandleDone(Request& request, Attempt& attempt,
                               const grpc::Status& generate_status, Actions* actions) {
  if (attempt.over() || request.ended) return false;
  const grpc::Status status = RefusedByDrainAsDown(generate_status, request.cancelled.load());
  if (attempt.stalled_on_down.load()) {
    if (CanRetry(request, attempt)) {
      retries_->WithLabels({"worker_down"}).Increment();
      request.AbortAll(actions);
      return true;
    }
    request.Fail(frontend::ServerError(
                     503,
                     absl::StrCat("decode worker ", attempt.decode->name(),
                                  " is down and its stream stalled for ",
                                  absl::FormatDuration(options_.stall_timeout), " or more"),
                     "server_error", "worker_unavailable"),
                 actions);
    return false;
  }
  const bool down = !status.ok() && WorkerDown(status.error_code());
  if (down) attempt.decode->RecordFailure();
  if ((down || ReservationLost(status, attempt.got_event.load())) && CanRetry(request, attempt)) {
    retries_
        ->WithLabels({status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? "timeout"
                                                                                 : "worker_down"})
        .Increment();
    request.AbortAll(actions);
    return true;
  }
  request.Fail(frontend::ServerError(status.ok() ? 500 : 503,
                                     absl::StrCat("decode worker ", attempt.decode->name(),
                                                  " ended the stream without a final event: ",
                                                  status.ok() ? "OK" : status.error_message()),
                                     "server_error", "worker_unavailable"),
               actions);
  return false;
}

void RouterService::CancelStalledStreams(Worker& decode) {
  const int64_t stalled_before = absl::ToUnixNanos(absl::Now() - options_.stall_timeout);
  std::vector<std::shared_ptr<Attempt>> stalled;
  {
    absl::MutexLock lock(&streams_mu_);
    std::erase_if(streams_, [&](const std::weak_ptr<Attempt>& a) {
      std::shared_ptr<Attempt> live = a.lock();
      if (live == nullptr) return true;
      if (live->decode != &decode || live->last_event_ns.load() > stalled_before) return false;
      stalled.push_back(std::move(live));
      return true;
    });
  }
  for (const std::shared_ptr<Attempt>& a : stalled) {
    spdlog::warn("router: decode worker {} is down; cancelling its stalled stream {}",
                 decode.name(), a->request_id);
    a->stalled_on_down.store(true);
    a->generate_context.TryCancel();  // OnGenerateDone fails or retries the choice
  }
}

void RouterService::CancelPrefillsOn(Worker& prefill) {
  std::vector<std::shared_ptr<Attempt>> cancel;
  {
    absl::MutexLock lock(&streams_mu_);
    for (const std::weak_ptr<Attempt>& weak : streams_) {
      std::shared_ptr<Attempt> a = weak.lock();
      // A Generate event means the transfer was committed: the decode worker has the state.
      if (a != nullptr && a->prefill == &prefill && a->prefill_pending.load() &&
          !a->got_event.load()) {
        cancel.push_back(std::move(a));
      }
    }
  }
  for (const std::shared_ptr<Attempt>& a : cancel) {
    if (a->prefill_on_down.exchange(true)) continue;
    spdlog::warn("router: prefill worker {} is down; cancelling its prefill of request {}",
                 prefill.name(), a->request_id);
    a->prefill_context.TryCancel();  // OnPrefilled retries the choice or fails it (503)
  }
}

}  // namespace pdserve::router
