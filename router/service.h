// The router's GenerationService: what `pdserve router` puts behind frontend::HttpServer (and
// the gRPC front, router/grpc_front.h). It prepares each request exactly as the colocated service
// does (frontend::RequestPreparer: same prompt tokens, same sampling defaults, same seed), then
// runs every choice on a prefill and a decode worker picked by the configured policies:
//
//   D.Reserve(request id, prompt length, sampling, lease) -> ticket
//   P.Prefill(request id, prompt, sampling, ticket)   }  concurrently
//   D.Generate(request id, ticket id) -> token stream  }
//
// and detokenizes the stream per choice (frontend::ChoiceText: UTF-8 safe, stop strings held
// back). Worker request ids are cluster-unique: a random 64-bit base plus a counter. The n choices
// of a request share ONE Reserve (SamplingParams.choice = 0, choice_count = n, n consecutive ids),
// ONE Prefill and ONE transfer; the decode worker forks the verified state, and choice k streams
// worker request id + k with its own stream (seed, k), so it equals choice k colocated
// (docs/protocol.md, "Shared prefill"). A retry or failure before any token covers every choice;
// a client gone aborts them all with one Abort per worker. The seed is always sent explicitly:
// the request's, else serving::EffectiveSeed of the response id, as the colocated service does.
//
// The first token's logprob and top_logprobs come from PrefillResponse.first_token (Generate's
// first event carries only its id): when logprobs are requested, a choice's Generate events are
// held until its Prefill has answered; a failed Prefill fails the request (a 5xx before any
// token), and a first token the two workers disagree on is a 500 "first_token_mismatch".
//
// Admission: a Reserve answered RESOURCE_EXHAUSTED (no batch slot or no state pages now) is no
// failed try: the choice asks the other decode workers that are up, and when every one is full
// it waits in the admission queue (router/admission_queue.h: first come first served; tried
// again when a reservation of this router ends, else after a short backoff) for up to
// options.queue_timeout, then the request gets 429 pool_exhausted (Retry-After). While choices
// wait, new requests queue behind them. A client gone while queued takes its choices out.
//
// Errors: more choices (n) than the widest decode worker's batch slots -> 400 (param n) before
// anything is reserved. No worker of a role up -> 503 naming why (NoWorkerUpError). Reserve's
// UNAVAILABLE -> 503,
// INVALID_ARGUMENT -> 400, FAILED_PRECONDITION (the request can never fit the worker's pool) ->
// 400 (param max_tokens). A Reserve whose answer was lost (past reserve_timeout, cancelled,
// connection lost) may still have reserved pages on its decode worker: it is aborted there with
// prefill_quiesced (no Prefill was sent), which frees them at once or makes the late Reserve fail.
// Prefill's (before any token, after a retry on another prefill worker when one is up):
// RESOURCE_EXHAUSTED -> 429 prefill_busy, UNAVAILABLE -> 503 worker_unavailable, a ticket the
// prefill worker refused (worker::kTicketMismatch, when no other decode worker is left to try)
// -> 503 workers_incompatible, DEADLINE_EXCEEDED
// (options.prefill_timeout) -> 503 prefill_timeout, others -> 500 prefill_failed with the worker's
// message; the decode reservation is aborted. A choice whose workers fail before it produced a
// token is retried once on other workers (pdserve_router_retries_total); after that, and for an
// "error" final event or a failed Prefill, the request fails with OnError (a 5xx JSON before any
// token, an SSE error event after). Cancel() (client gone) aborts the choice on both workers
// (Abort) and cancels the calls. Loads are counted at dispatch and released when a worker's part
// ends.
//
// Thread-safety: every method is thread-safe. Sinks are called with the request's lock held and
// must not call back into the Generation synchronously (frontend::HttpServer posts).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/deploy_config.h"
#include "common/metrics.h"
#include "frontend/generation_service.h"
#include "frontend/request_preparer.h"
#include "router/admission_queue.h"
#include "router/policy.h"
#include "router/worker_pool.h"

namespace pdserve::router {

// Work to run once a Request's lock is released (Abort calls, cancellations).
using Actions = std::vector<std::function<void()>>;

struct RouterOptions {
  std::string model_dir;
  std::string served_name;  // accepted in "model" besides the directory name; may be empty
  std::vector<config::WorkerConfig> prefill;
  std::vector<config::WorkerConfig> decode;
  PolicyKind prefill_policy = PolicyKind::kLeastLoad;
  PolicyKind decode_policy = PolicyKind::kLeastLoad;
  int64_t prefix_load_cap = 8;
  absl::Duration health_interval = absl::Seconds(1);
  absl::Duration health_down_retry = absl::Seconds(1);  // WorkerPoolOptions::down_retry
  absl::Duration health_timeout = absl::Seconds(2);
  absl::Duration canary_timeout = absl::Seconds(5);
  bool canary = true;  // false: Health RPC only (tests with fake workers may turn it off)
  bool background_checks = true;  // false: workers are checked only by pool().CheckAll()
  int64_t lease_ms = 30000;
  absl::Duration reserve_timeout = absl::Seconds(10);
  // The Prefill RPC's deadline: how long a prefill worker may take to answer (its queue wait
  // included) before the choice fails (503 prefill_timeout, retried on another prefill worker
  // before any token). router.prefill_timeout_ms; independent of the transfer lease, which only
  // bounds a transfer between heartbeats. A worker the health checker marks down does not wait
  // for it: its Prefill calls are cancelled then (CancelPrefillsOn).
  absl::Duration prefill_timeout = absl::Seconds(60);
  // A Generate stream on a decode worker the health checker holds down that has had no event
  // for this long is cancelled and its choice fails (503 worker_unavailable, retried on another
  // decode worker when no token went out), instead of hanging until the worker comes back.
  absl::Duration stall_timeout = absl::Seconds(10);
  int max_attempts = 2;          // per choice: the first try plus retries before any token
  int64_t max_in_flight = 4096;  // worker requests, queued ones included; beyond: 429 at once
  // How long a choice may wait in the admission queue for room on a decode worker (every one
  // answered RESOURCE_EXHAUSTED: no batch slot or no state pages) before the request gets 429
  // with Retry-After. router.queue_timeout_ms; zero: no waiting, 429 at once.
  absl::Duration queue_timeout = absl::Seconds(60);
  // At most this many of this router's requests are dispatched to one prefill worker at a time
  // (from its Reserve until its Prefill answers); when every prefill worker that is up holds
  // that many, a new choice waits in the admission queue (with the same queue_timeout, then 429
  // prefill_busy) and reserves no decode pages meanwhile. The prefill worker runs one prefill at
  // a time, so 2 keeps the next one waiting there (no gap between prefills) while the rest wait
  // here, where no transfer lease runs (docs/architecture.md, "Admission").
  // router.max_prefills_per_worker; 0: no cap (every request goes to a prefill worker's own
  // queue at once, which gives up after half the transfer lease).
  int64_t max_prefills_per_worker = 2;
  AdmissionQueue::Options queue;  // its backoff for tries nobody signalled
  // Credentials of the channels to the workers (mutual TLS under security.cluster_tls,
  // common/tls_credentials.h); null: insecure.
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
};

// The options a deploy config gives the router.
absl::StatusOr<RouterOptions> OptionsFromConfig(const config::DeployConfig& config);

class RouterService : public frontend::GenerationService {
 public:
  // Loads the tokenizer and configs of options.model_dir (no weights), connects to the workers
  // and starts the health checker. Errors: the model loaders', InvalidArgument for no workers.
  static absl::StatusOr<std::unique_ptr<RouterService>> Create(const RouterOptions& options);
  // Cancels the requests still running (no further sink calls), stops the checker.
  ~RouterService() override;

  // Accepted in "model": the served name, the model directory's name and its path.
  std::vector<std::string> ModelNames() const override;
  // Listed: the served name and the directory's name, each once (never the path).
  std::vector<std::string> ListedModelNames() const override;
  int64_t MaxModelLength() const override { return preparer_->context_length(); }
  // Counts a 400 / 404 the front answered (pdserve_router_requests_total{code, "error"}).
  void RecordRejected(frontend::Endpoint endpoint, frontend::Front front, int http_status) override;
  // Counted like RecordRejected; without an endpoint under endpoint="unknown".
  void RecordRefused(std::optional<frontend::Endpoint> endpoint, int http_status) override;
  // pdserve_router_slow_stream_ends_total{endpoint, reason}.
  void RecordStreamEnded(frontend::Endpoint endpoint, frontend::Front front,
                         const std::string& reason) override;
  frontend::StartResult Start(const frontend::ApiRequest& req,
                              std::shared_ptr<frontend::GenerationSink> sink) override;
  bool Ready() const override;
  std::string MetricsText() const override;

  WorkerPool& pool() { return *pool_; }
  const frontend::RequestPreparer& preparer() const { return *preparer_; }
  // Worker requests dispatched and not finished (all choices of all requests).
  int64_t in_flight() const { return in_flight_.load(); }

  struct Request;
  struct Attempt;
  struct Choice;

 private:
  class RouterGeneration;
  friend struct Request;
  RouterService() = default;
  uint64_t NextRequestId() { return id_base_ + next_id_.fetch_add(1); }
  // `n` consecutive worker request ids (a shared reservation's forks); returns the first.
  uint64_t NextRequestIds(int n) {
    return id_base_ + next_id_.fetch_add(static_cast<uint64_t>(std::max(n, 1)));
  }
  // Picks workers and sends Reserve for choice `choice` of `request`, skipping the decode
  // workers that answered "no room" for it since it last left the queue and the prefill workers
  // that hold options.max_prefills_per_worker (when all do, the choice waits in the queue).
  // `exclude_*`: the workers of a failed attempt (-1: none). `from_queue`: the admission queue's
  // try. Returns whether a Reserve was sent or the choice went back to the queue (false: the
  // request is gone, or it failed for want of workers).
  bool Dispatch(const std::shared_ptr<Request>& request, int choice, int exclude_prefill,
                int exclude_decode, bool from_queue = false);
  // REQUIRES: request.mu held. Choice `choice` found every decode worker full or every prefill
  // worker at max_prefills_per_worker (request.waits_for_prefill), or arrived while others wait:
  // it waits in the admission queue, in its old place when it waited before, until its wait
  // passes options.queue_timeout; past that (or with no queue) the request fails with 429
  // pool_exhausted (decode room) or prefill_busy (prefill room).
  void Enqueue(Request& request, int choice, Actions* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  // The admission queue's callbacks (its thread): a try for a waiting choice, and the end of a
  // wait that passed its deadline (429).
  bool Admit(const std::shared_ptr<Request>& request, int choice);
  void Expire(const std::shared_ptr<Request>& request, int choice);
  // Marks the prefill candidates holding options.max_prefills_per_worker of this router's
  // requests as not to be picked; returns whether that left none of those up (the choice waits
  // for prefill room). Always false with no cap.
  bool PrefillFull(std::vector<Candidate>* candidates) const;
  // REQUIRES: the choice's request.mu held. " after prefill worker X failed it" when a prefill
  // worker failed `choice` and its retry waits for room on another (Choice::failed_prefill),
  // else empty: the end of a prefill_busy message.
  std::string FailedPrefillDetail(const Choice& choice) const;
  // REQUIRES: request.mu held. Whether a decode worker that is up has not answered "no room" for
  // `choice` yet.
  bool DecodeLeftToAsk(Request& request, int choice) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  // REQUIRES: request.mu held. Whether a decode worker that answered "no room" for `choice` is
  // up: the choice may wait for room there rather than fail when the others are down.
  bool FullDecodeUp(Request& request, int choice) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  // Counts a finished request (finish_reason empty: the choices' own reasons).
  void RecordFinish(Request& request, int http_status, const std::string& finish_reason);
  // Sends Abort to `worker` without waiting for the answer (counted in calls_).
  // `prefill_quiesced` goes into a decode worker's AbortRequest (ignored for a prefill worker).
  // `then` (optional) runs on the answer with its `quiesced` (false when the call failed).
  void SendAbort(Worker& worker, uint64_t request_id, uint64_t ticket_id,
                 bool prefill_quiesced = false, std::function<void(bool quiesced)> then = nullptr,
                 uint32_t forks = 1);
  // Aborts on the prefill worker first, then on the decode worker with prefill_quiesced from the
  // prefill worker's answer, so the decode worker frees the pages at once when nothing is in
  // flight (docs/protocol.md, "Abort").
  // `forks`: how many forks of a shared reservation the decode worker's Abort covers
  // (AbortRequest.choice_count).
  void SendAbortPrefillThenDecode(Worker& prefill, Worker& decode, uint64_t request_id,
                                  uint64_t ticket_id, uint32_t forks = 1);
  // Gives back the load an attempt holds on its prefill and / or decode worker (`decode_units`:
  // the sequences it gives back there: a lead whose reservation never streamed gives back its
  // whole group). `reserved`: its Reserve succeeded, so the end of its decode side frees a batch
  // slot (RoomFreed).
  void ReleaseAttempt(Attempt& attempt, bool prefill, bool decode, bool reserved = true,
                      int decode_units = 1);
  bool CanRetry(Request& request, const Attempt& attempt) const;
  // The 400 (param n) for a request of `n` choices that can never run at once: its choices share
  // one reservation on one decode worker, and n is more than the widest worker's batch slots
  // (HealthResponse.max_batch; no bound while a worker has not stated it). Nothing is reserved
  // for such a request.
  std::optional<frontend::ApiError> FanOutError(int n) const;
  // The 503 while no worker of `prefill` and / or `decode`'s role is up: names each down
  // worker's last check failure (WorkerPool::NoWorkerUp); code workers_incompatible when each of
  // them is down for a mismatch (a pair that refuses each other, another model), else
  // worker_unavailable.
  frontend::ApiError NoWorkerUpError(bool prefill, bool decode) const;
  // Whether a prefill worker other than the attempt's is up.
  bool OtherPrefillUp(const Attempt& attempt) const;
  // Whether a decode worker other than the attempt's is up.
  bool OtherDecodeUp(const Attempt& attempt) const;
  // Where a failed attempt's choice is dispatched again: its Dispatch arguments (decode -2: not
  // dispatched again).
  struct Retry {
    int prefill = -2;
    int decode = -2;
    bool from_queue = false;
  };
  // gRPC completions (gRPC callback threads).
  void OnReserved(const std::shared_ptr<Request>& request, const std::shared_ptr<Attempt>& attempt,
                  const grpc::Status& status);
  void OnPrefilled(const std::shared_ptr<Request>& request, const std::shared_ptr<Attempt>& attempt,
                   const grpc::Status& status);
  // REQUIRES: request.mu held. OnReserved's two outcomes: a failed Reserve (retried on another
  // decode worker, queued, or the request fails), and a reservation (false: not wanted any
  // more, it is aborted at once; true: start the streams).
  Retry ReserveFailed(Request& request, Attempt& attempt, const grpc::Status& reserve_status,
                      Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  bool Reserved(Request& request, Attempt& attempt, Actions* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  // REQUIRES: request.mu held. Creates the lead's member attempts (choices 1 .. count - 1 of
  // its reservation, reserved with it); false when a move was illegal (the request failed).
  bool AddMembers(Request& request, Attempt& lead, Actions* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  // REQUIRES: request.mu held. The lead's Prefill answered OK: `attempt` (the lead or a member)
  // takes its first token's logprobs and replays its held events; sets the retry flags.
  void PrefillAnswered(Request& request, const Attempt& lead, Attempt& attempt, bool* retry,
                       bool* retry_decode, Actions* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu);
  // The choice a retry of `attempt`'s group is dispatched as: its lead's.
  static int GroupChoice(const Attempt& attempt);
  // Sends the lead's Prefill and opens the Generate stream of every attempt of its group.
  void StartStreams(const std::shared_ptr<Request>& request,
                    const std::shared_ptr<Attempt>& attempt);
  void OnGenerateEvent(Request& request, Attempt& attempt,
                       const worker::v1::GenerateResponse& event);
  void OnGenerateDone(Request& request, Attempt& attempt, const grpc::Status& status);
  // REQUIRES: request.mu held. One Generate event of `attempt` (the first token's logprobs
  // taken from the Prefill answer when logprobs are requested). Returns whether the choice is to
  // be dispatched again on another prefill worker (its transfer lease ran out before any token).
  bool HandleEvent(Request& request, Attempt& attempt, const worker::v1::GenerateResponse& event,
                   Actions* actions);
  // REQUIRES: request.mu held. HandleEvent's parts: the degeneration flag; the event's tokens
  // (false: the request failed); the final event's outcome (true: dispatch the choice again).
  void NoteDegeneration(Request& request, const Attempt& attempt,
                        const worker::v1::GenerateResponse& event);
  bool EmitTokens(Request& request, const Attempt& attempt,
                  const worker::v1::GenerateResponse& event, bool first_event, Actions* actions);
  bool HandleFinish(Request& request, Attempt& attempt, const worker::v1::GenerateResponse& event,
                    Actions* actions);
  // REQUIRES: request.mu held. The end of `attempt`'s Generate stream without a final event.
  // Returns whether the choice is to be dispatched again (on another decode worker).
  bool HandleDone(Request& request, Attempt& attempt, const grpc::Status& generate_status,
                  Actions* actions);

  // The checker found `decode` still down: cancels its streams stalled past stall_timeout.
  void CancelStalledStreams(Worker& decode);
  // The checker found `prefill` down: cancels its Prefill calls still out whose transfer has not
  // committed (no Generate event yet); each choice is retried on another prefill worker before
  // any token (pdserve_router_retries_total{reason="worker_down"}), else fails with 503
  // worker_unavailable, instead of waiting out prefill_timeout.
  void CancelPrefillsOn(Worker& prefill);

  RouterOptions options_;
  std::vector<std::string> model_names_;
  // Attempts whose Generate stream was started (pruned as they go); declared before pool_ so
  // they outlive the checker's calls.
  absl::Mutex streams_mu_;
  std::vector<std::weak_ptr<Attempt>> streams_ ABSL_GUARDED_BY(streams_mu_);
  std::unique_ptr<frontend::RequestPreparer> preparer_;
  std::unique_ptr<WorkerPool> pool_;
  // Its thread is stopped first in the destructor; null when options.queue_timeout is zero.
  std::unique_ptr<AdmissionQueue> queue_;
  std::unique_ptr<Policy> prefill_policy_;
  std::unique_ptr<Policy> decode_policy_;
  uint64_t id_base_ = 0;
  std::atomic<uint64_t> next_id_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> calls_{0};  // Prefill and Abort calls not yet answered

  metrics::Registry registry_;
  metrics::Family<metrics::Counter>* requests_ = nullptr;
  metrics::Family<metrics::Histogram>* ttft_ = nullptr;
  metrics::Family<metrics::Histogram>* itl_ = nullptr;
  metrics::Family<metrics::Histogram>* tpot_ = nullptr;
  metrics::Family<metrics::Histogram>* e2e_ = nullptr;
  metrics::Family<metrics::Histogram>* queue_time_ = nullptr;
  metrics::Family<metrics::Gauge>* queue_depth_ = nullptr;
  metrics::Family<metrics::Counter>* queued_ = nullptr;
  metrics::Family<metrics::Histogram>* queue_wait_ = nullptr;
  metrics::Family<metrics::Counter>* prompt_tokens_ = nullptr;
  metrics::Family<metrics::Counter>* generation_tokens_ = nullptr;
  metrics::Family<metrics::Gauge>* requests_in_flight_ = nullptr;
  metrics::Family<metrics::Counter>* retries_ = nullptr;
  metrics::Family<metrics::Counter>* slow_streams_ = nullptr;
  metrics::Family<metrics::Gauge>* worker_up_ = nullptr;
  metrics::Family<metrics::Counter>* degenerate_ = nullptr;
};

}  // namespace pdserve::router
