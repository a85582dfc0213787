#include "router/worker_pool.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/host_port.h"
#include "common/model_fingerprint.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"
#include "worker/transfer_peer.h"

namespace pdserve::router {
namespace {

namespace wv1 = worker::v1;

std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
}

}  // namespace

const char* RoleName(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

void SetPrefillCudaIpc(const Worker& prefill, wv1::ReserveRequest* reserve) {
  if (std::optional<wv1::CudaIpcSource> source = prefill.cuda_ipc()) {
    *reserve->mutable_prefill_cuda_ipc() = std::move(*source);
  }
}

std::string ModelIdentity::ToString(const char* unset) const {
  return absl::StrCat("model ", model.empty() ? unset : model, ", fingerprint ",
                      fingerprint == 0 ? unset : common::FingerprintText(fingerprint),
                      ", geometry ", page_geometry.empty() ? unset : page_geometry);
}

std::string DescribeModelMismatch(const ModelIdentity& stated, const ModelIdentity& cluster) {
  // A field differs when both sides know it (SameModel's rule).
  std::vector<std::string> differ;
  if (!stated.model.empty() && !cluster.model.empty() && stated.model != cluster.model) {
    differ.push_back("model");
  }
  if (stated.fingerprint != 0 && cluster.fingerprint != 0 &&
      stated.fingerprint != cluster.fingerprint) {
    differ.push_back("fingerprint");
  }
  if (!stated.page_geometry.empty() && !cluster.page_geometry.empty() &&
      stated.page_geometry != cluster.page_geometry) {
    differ.push_back("geometry");
  }
  return absl::StrCat("differs in ", absl::StrJoin(differ, ", "), ": it states ", stated.ToString(),
                      "; the cluster is ", cluster.ToString("not known yet"));
}

Worker::Worker(config::WorkerConfig config, Role role, int breaker_failures,
               std::shared_ptr<grpc::ChannelCredentials> credentials)
    : config_(std::move(config)), role_(role), breaker_failures_(breaker_failures) {
  grpc::ChannelArguments args;
  // Each worker gets its own connection even when two share an address in tests.
  args.SetInt("grpc.use_local_subchannel_pool", 1);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20);
  // A worker that comes back is seen by the next health check, not at gRPC's next reconnect:
  // by default those back off from 1 s by 1.6x up to 120 s, so a decode worker down 60 s was
  // seen up 9-16 s after it served again (the router answered 503 meanwhile), and one down for
  // minutes up to 2 minutes late. Connecting to a worker that is down costs a refused connect.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A link that goes away without a reset (a cable, a dead host) leaves the connection open:
  // calls time out, and after the link returns TCP's retransmission backoff kept the router
  // from the worker for another 17-30 s (tests/router/netns_cluster_test.py). HTTP/2 pings
  // every 2 s, answered within 2 s, close such a connection, so the next health check
  // reconnects. The workers permit these pings (worker/worker_process.cc).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  channel_ = grpc::CreateCustomChannel(
      address(), credentials ? credentials : grpc::InsecureChannelCredentials(), args);
  if (role_ == Role::kDecode) {
    decode_ = wv1::DecodeWorker::NewStub(channel_);
  } else {
    prefill_ = wv1::PrefillWorker::NewStub(channel_);
  }
}

std::string Worker::address() const { return common::HostPort(config_.host, config_.port); }

void Worker::RecordSuccess() { request_failures_.store(0); }

void Worker::RecordFailure() {
  if (request_failures_.fetch_add(1) + 1 >= breaker_failures_ && !breaker_open_.exchange(true)) {
    spdlog::warn("router: {} worker {} circuit breaker open after {} failures", RoleName(role_),
                 name(), breaker_failures_);
  }
}

void Worker::RecordCheck(bool passed, int down_after) {
  if (passed) {
    check_failures_.store(0);
    request_failures_.store(0);
    const bool was_up = up();
    breaker_open_.store(false);
    if (!healthy_.exchange(true) || !was_up) {
      spdlog::info("router: {} worker {} is up", RoleName(role_), name());
    }
    return;
  }
  if (check_failures_.fetch_add(1) + 1 >= down_after && healthy_.exchange(false)) {
    spdlog::warn("router: {} worker {} marked down ({} failed checks)", RoleName(role_), name(),
                 down_after);
  }
}

WorkerPool::WorkerPool(WorkerPoolOptions options, std::function<uint64_t()> next_request_id)
    : options_(std::move(options)),
      next_request_id_(std::move(next_request_id)),
      cluster_(options_.expected) {
  for (const config::WorkerConfig& w : options_.prefill) {
    prefill_.push_back(std::make_unique<Worker>(w, Role::kPrefill, options_.breaker_failures,
                                                options_.credentials));
  }
  for (const config::WorkerConfig& w : options_.decode) {
    decode_.push_back(std::make_unique<Worker>(w, Role::kDecode, options_.breaker_failures,
                                               options_.credentials));
  }
  if (!options_.background_checks) return;
  for (auto& w : decode_) checkers_.emplace_back([this, w = w.get()] { Loop(*w); });
  for (auto& w : prefill_) checkers_.emplace_back([this, w = w.get()] { Loop(*w); });
}

class WorkerPool::CallScope {
 public:
  CallScope(WorkerPool& pool, grpc::ClientContext* context) : pool_(pool), context_(context) {
    absl::MutexLock lock(&pool_.mu_);
    if (pool_.stop_) context_->TryCancel();  // (gRPC cancels a call not started yet at its start)
    pool_.calls_.insert(context_);
  }
  ~CallScope() {
    absl::MutexLock lock(&pool_.mu_);
    pool_.calls_.erase(context_);
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  WorkerPool& pool_;
  grpc::ClientContext* context_;
};

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    // Checks in flight end now rather than at their deadline (a worker that stopped answering).
    for (grpc::ClientContext* context : calls_) context->TryCancel();
  }
  for (std::thread& t : checkers_) t.join();
}

std::vector<Worker*> WorkerPool::prefill() const {
  std::vector<Worker*> out;
  for (const auto& w : prefill_) out.push_back(w.get());
  return out;
}

std::vector<Worker*> WorkerPool::decode() const {
  std::vector<Worker*> out;
  for (const auto& w : decode_) out.push_back(w.get());
  return out;
}

bool WorkerPool::Ready() const {
  bool prefill_up = false, decode_up = false;
  for (const auto& w : prefill_) prefill_up |= w->up();
  for (const auto& w : decode_) decode_up |= w->up();
  return prefill_up && decode_up;
}

void WorkerPool::Loop(Worker& worker) {
  while (true) {
    CheckAndRecord(worker);
    const absl::Duration wait = worker.up()
                                    ? options_.health_interval
                                    : std::min(options_.health_interval, options_.down_retry);
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), wait)) return;
  }
}

void WorkerPool::CheckAll() {
  for (auto& w : decode_) CheckAndRecord(*w);
  for (auto& w : prefill_) CheckAndRecord(*w);
}

void WorkerPool::CheckAndRecord(Worker& worker) {
  CheckResult result = Check(worker);
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;  // a check cut off by the shutdown says nothing about the worker
  }
  const bool passed = result.verdict == Verdict::kPassed;
  if (passed) result.failure = {};
  const std::string reason = result.failure.reason;
  // Once per change: a pair that cannot work fails every check the same way until restarted.
  if (worker.RecordCheckFailure(std::move(result.failure)) && result.log_on_change) {
    spdlog::warn("router: {} worker {} failed its check: {}", RoleName(worker.role()),
                 worker.name(), reason);
  }
  worker.RecordCheck(passed, result.verdict == Verdict::kWrongModel ? 1 : options_.down_after);
  if (!passed && !worker.up() && options_.on_still_down) options_.on_still_down(worker);
}

WorkerPool::Unavailable WorkerPool::NoWorkerUp(Role role) const {
  constexpr int kNamed = 4;
  const auto& workers = role == Role::kPrefill ? prefill_ : decode_;
  Unavailable out;
  out.mismatch = !workers.empty();
  std::vector<std::string> reasons;
  int unnamed = 0;
  for (const auto& w : workers) {
    if (w->up()) continue;  // came up since the caller looked
    const Worker::CheckFailure failure = w->check_failure();
    out.mismatch = out.mismatch && failure.mismatch;
    if (static_cast<int>(reasons.size()) == kNamed) {
      ++unnamed;
      continue;
    }
    std::string reason = failure.reason;
    if (reason.empty()) {
      reason = w->breaker_open() ? "its circuit breaker is open (requests to it failed in a row)"
                                 : "no health check has passed yet";
    }
    reasons.push_back(absl::StrCat(w->name(), ": ", reason));
  }
  if (unnamed > 0) reasons.push_back(absl::StrCat(unnamed, " more"));
  out.message = absl::StrCat("no ", RoleName(role), " worker is up");
  if (!reasons.empty()) absl::StrAppend(&out.message, " (", absl::StrJoin(reasons, "; "), ")");
  return out;
}

bool WorkerPool::SameModel(Worker& worker, const ModelIdentity& stated) {
  ModelIdentity cluster;
  bool same = true;
  {
    absl::MutexLock lock(&identity_mu_);
    // Only a worker that matches every known field may fill in the unknown ones.
    same = (stated.model.empty() || cluster_.model.empty() || stated.model == cluster_.model) &&
           (stated.fingerprint == 0 || cluster_.fingerprint == 0 ||
            stated.fingerprint == cluster_.fingerprint) &&
           (stated.page_geometry.empty() || cluster_.page_geometry.empty() ||
            stated.page_geometry == cluster_.page_geometry);
    if (same) {
      if (cluster_.model.empty()) cluster_.model = stated.model;
      if (cluster_.fingerprint == 0) cluster_.fingerprint = stated.fingerprint;
      if (cluster_.page_geometry.empty()) cluster_.page_geometry = stated.page_geometry;
    }
    cluster = cluster_;
  }
  // Logged once per identity: again when a worker restarts on yet another model.
  const uint64_t stated_hash = same ? 0 : (std::hash<std::string>()(stated.ToString()) | 1);
  const uint64_t previous = worker.ExchangeWrongModel(stated_hash);
  if (!same && previous != stated_hash) {
    spdlog::error(
        "router: {} worker {} serves another model than the cluster, marked down until it "
        "does; it {}",
        RoleName(worker.role()), worker.name(), DescribeModelMismatch(stated, cluster));
  }
  if (same && previous != 0) {
    spdlog::info("router: {} worker {} now serves the cluster's model ({})",
                 RoleName(worker.role()), worker.name(), stated.ToString());
  }
  return same;
}

WorkerPool::CheckResult WorkerPool::Check(Worker& worker) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(options_.health_timeout));
  const CallScope scope(*this, &context);
  wv1::HealthResponse health;
  const grpc::Status status =
      worker.role() == Role::kDecode
          ? worker.decode()->Health(&context, wv1::HealthRequest(), &health)
          : worker.prefill()->Health(&context, wv1::HealthRequest(), &health);
  // Why a check failed is logged while the worker is up (at most down_after lines an outage).
  if (!status.ok()) {
    if (worker.up()) {
      spdlog::info("router: health check of {} worker {} failed: {} ({})", RoleName(worker.role()),
                   worker.name(), status.error_message(), static_cast<int>(status.error_code()));
    }
    return {Verdict::kFailed,
            {absl::StrCat("its health check failed: ", status.error_message(), " (code ",
                          static_cast<int>(status.error_code()), ")")}};
  }
  if (health.state() != wv1::HealthResponse::STATE_SERVING) {
    if (worker.up()) {
      spdlog::info("router: {} worker {} is not serving (health state {})", RoleName(worker.role()),
                   worker.name(), static_cast<int>(health.state()));
    }
    return {Verdict::kFailed,
            {absl::StrCat("it is not serving (health state ",
                          wv1::HealthResponse::State_Name(health.state()), ")")}};
  }
  const ModelIdentity stated{health.model(), health.model_fingerprint(), health.page_geometry()};
  if (!SameModel(worker, stated)) {
    ModelIdentity cluster;
    {
      absl::MutexLock lock(&identity_mu_);
      cluster = cluster_;
    }
    return {Verdict::kWrongModel,
            {absl::StrCat("it serves another model than the cluster: it ",
                          DescribeModelMismatch(stated, cluster)),
             /*mismatch=*/true}};
  }
  if (worker.role() == Role::kDecode) worker.set_max_batch(health.max_batch());
  if (worker.role() == Role::kPrefill) {
    worker.set_cuda_ipc(health.has_cuda_ipc() ? std::make_optional(health.cuda_ipc())
                                              : std::nullopt);
  }
  if (options_.canary_prompt.empty()) return {};
  return CanaryThroughPartners(worker);
}

WorkerPool::CheckResult WorkerPool::CanaryThroughPartners(Worker& worker) {
  // A canary may take canary_timeout: a check tries this many partners at most.
  constexpr int kMaxPartners = 4;
  const auto& partners = worker.role() == Role::kDecode ? prefill_ : decode_;
  int tried = 0;
  std::vector<std::string> refusals;  // the pairs that cannot work, one reason each
  for (const auto& partner : partners) {
    // A partner that is down is no proof either way (its own check decides about it).
    if (!partner->up()) continue;
    if (tried++ == kMaxPartners) break;
    Worker& p = worker.role() == Role::kPrefill ? worker : *partner;
    Worker& d = worker.role() == Role::kDecode ? worker : *partner;
    std::string why;
    const CanaryResult result = Canary(p, d, worker.role(), &why);
    const bool own_step = (result == CanaryResult::kPrefillFailed && &p == &worker) ||
                          (result == CanaryResult::kDecodeFailed && &d == &worker);
    if (result == CanaryResult::kPassed) return {};
    if (own_step) return {Verdict::kFailed, {why}, /*log_on_change=*/true};
    if (result == CanaryResult::kPairFailed) refusals.push_back(std::move(why));
    // Otherwise the partner's own step failed: try another.
  }
  // No partner up, or only partners whose own steps failed: Health alone decides (the canary
  // would blame this worker for its partner). Every partner refused the pair: this worker too.
  if (refusals.empty()) return {};
  return {Verdict::kFailed,
          {absl::StrCat("every up partner it was tried with refused the pair: ",
                        absl::StrJoin(refusals, "; ")),
           /*mismatch=*/true},
          /*log_on_change=*/true};
}

// One real generation of one token: Reserve on `decode`, then Prefill and Generate together.
// Says whose step failed: the prefill worker's, the decode worker's (its Reserve, its Generate,
// or the transfer to it: worker::kTransferPeerFailed), or the pair's (worker::kTicketMismatch).
// A busy prefill worker under check (`checked` kPrefill, PrefillBusy) passes.
WorkerPool::CanaryResult WorkerPool::Canary(Worker& prefill, Worker& decode, Role checked,
                                            std::string* why) {
  const uint64_t request_id = next_request_id_();
  wv1::SamplingParams sampling;
  sampling.set_temperature(0);
  sampling.set_top_p(1);
  sampling.set_repetition_penalty(1);
  sampling.set_max_tokens(1);
  sampling.set_seed(0);
  const auto deadline = Deadline(options_.canary_timeout);

  wv1::ReserveRequest reserve;
  reserve.set_request_id(request_id);
  reserve.set_prompt_tokens(static_cast<int32_t>(options_.canary_prompt.size()));
  for (int32_t t : options_.canary_prompt) reserve.add_prompt_token_ids(t);
  *reserve.mutable_sampling() = sampling;
  reserve.set_lease_ms(options_.lease_ms);
  SetPrefillCudaIpc(prefill, &reserve);
  wv1::ReserveResponse reserved;
  grpc::ClientContext reserve_context;
  reserve_context.set_deadline(deadline);
  const CallScope reserve_scope(*this, &reserve_context);
  grpc::Status status = decode.decode()->Reserve(&reserve_context, reserve, &reserved);
  auto abort_both = [&] {
    wv1::AbortRequest abort;
    abort.set_request_id(request_id);
    wv1::AbortResponse prefill_answer, ignored;
    grpc::ClientContext c1, c2;
    c1.set_deadline(Deadline(absl::Seconds(1)));
    c2.set_deadline(Deadline(absl::Seconds(1)));
    // Prefill first: its quiesced answer lets the decode worker free the pages at once.
    const bool quiesced =
        prefill.prefill()->Abort(&c2, abort, &prefill_answer).ok() && prefill_answer.quiesced();
    abort.set_prefill_quiesced(quiesced);
    decode.decode()->Abort(&c1, abort, &ignored).ok();
  };
  if (!status.ok()) {
    // RESOURCE_EXHAUSTED: a full worker is busy, not broken.
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) return CanaryResult::kPassed;
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // The Reserve may have run on the worker after all: no Prefill was sent, so it frees the
      // pages at once (and refuses a Reserve the Abort overtook).
      wv1::AbortRequest abort;
      abort.set_request_id(request_id);
      abort.set_prefill_quiesced(true);
      wv1::AbortResponse ignored;
      grpc::ClientContext abort_context;
      abort_context.set_deadline(Deadline(absl::Seconds(1)));
      decode.decode()->Abort(&abort_context, abort, &ignored).ok();
    }
    *why = absl::StrCat("canary Reserve on decode worker ", decode.name(),
                        " failed: ", WithoutRequestId(status.error_message()));
    return CanaryResult::kDecodeFailed;
  }

  wv1::PrefillRequest prefill_request;
  prefill_request.set_request_id(request_id);
  for (int32_t t : options_.canary_prompt) prefill_request.add_token_ids(t);
  *prefill_request.mutable_sampling() = sampling;
  *prefill_request.mutable_ticket() = reserved.ticket();
  wv1::PrefillResponse prefilled;
  grpc::ClientContext prefill_context;
  prefill_context.set_deadline(deadline);
  const CallScope prefill_scope(*this, &prefill_context);
  grpc::ClientContext generate_context;
  generate_context.set_deadline(deadline);
  const CallScope generate_scope(*this, &generate_context);
  grpc::Status prefill_status;
  absl::Notification prefill_done;
  prefill.prefill()->async()->Prefill(&prefill_context, &prefill_request, &prefilled,
                                      [&](grpc::Status s) {
                                        // No state will reach the decode worker: its Generate
                                        // would wait for it until the deadline. (A call not
                                        // started yet is cancelled at its start.)
                                        if (!s.ok()) generate_context.TryCancel();
                                        prefill_status = std::move(s);
                                        prefill_done.Notify();
                                      });

  wv1::GenerateRequest generate;
  generate.set_request_id(request_id);
  generate.set_ticket_id(reserved.ticket().ticket_id());
  std::unique_ptr<grpc::ClientReader<wv1::GenerateResponse>> reader =
      decode.decode()->Generate(&generate_context, generate);
  wv1::GenerateResponse event;
  std::string finish;
  std::string error_message;  // an "error" or "abort" final event's
  int tokens = 0;
  while (reader->Read(&event)) {
    tokens += event.token_ids_size();
    if (!event.finish_reason().empty()) finish = event.finish_reason();
    if (!event.error_message().empty()) error_message = event.error_message();
  }
  const grpc::Status generate_status = reader->Finish();
  prefill_done.WaitForNotification();  // the deadline bounds it
  const bool generated = generate_status.ok() && tokens >= 1 &&
                         (finish == "stop" || finish == "length" || finish == "degenerate");
  if (generated && prefill_status.ok()) return CanaryResult::kPassed;
  abort_both();
  if (checked == Role::kPrefill &&
      prefill_status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && PrefillBusy(prefill)) {
    // One line per check while a long prompt runs, not a warning: nothing is wrong.
    spdlog::info("router: prefill worker {} is busy (canary timed out in its queue), not down",
                 prefill.name());
    return CanaryResult::kPassed;
  }
  // Which worker a failure counts against is the caller's decision (a partner's failed step
  // does not fail this check); the reason is logged by the check it fails, once per change.
  // The canary's request id is new at every check; without it one failure reads as one reason.
  const std::string prefill_message = WithoutRequestId(prefill_status.error_message());
  CanaryResult result = CanaryResult::kPrefillFailed;
  if (prefill_status.error_details() == worker::kTicketMismatch) {
    *why = absl::StrCat("prefill worker ", prefill.name(), " refused the ticket of decode worker ",
                        decode.name(), ": ", prefill_message);
    result = CanaryResult::kPairFailed;
  } else if (!prefill_status.ok()) {
    // Its Generate was cancelled: only the Prefill's status says what went wrong.
    *why = absl::StrCat("canary through ", prefill.name(), " and ", decode.name(),
                        " failed in Prefill: ", prefill_message);
    if (prefill_status.error_details() == worker::kTransferPeerFailed) {
      result = CanaryResult::kDecodeFailed;
    }
  } else {
    *why = absl::StrCat("canary through ", prefill.name(), " and ", decode.name(),
                        " failed in Generate: ",
                        generate_status.ok() ? error_message : generate_status.error_message(),
                        " (", tokens, " tokens, finish '", finish, "')");
    result = CanaryResult::kDecodeFailed;
  }
  spdlog::debug("router: {}", *why);
  return result;
}

bool WorkerPool::PrefillBusy(Worker& prefill) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(options_.health_timeout));
  const CallScope scope(*this, &context);
  wv1::StatsResponse stats;
  const grpc::Status status = prefill.prefill()->Stats(&context, wv1::StatsRequest(), &stats);
  if (!status.ok()) return false;
  // Bytes sent and prompt tokens prefilled: both only grow. A long prompt's forward sends
  // nothing until its state is ready (a 600-token prompt of kjv-v4-wide on a loaded 2-core
  // machine: tens of seconds), so bytes alone called such a worker wedged on the second sample,
  // marked it down and cancelled the prefill.
  // One chunk can outlast several checks on a slow or loaded host, hence its layers too.
  const int64_t progress =
      stats.transfer_bytes() + stats.prefilled_tokens() + stats.forward_layers();
  const int64_t previous = prefill.ExchangeProgress(progress);
  const bool has_work = stats.waiting_requests() + stats.running_requests() > 0;
  // Progress since the previous sample: also when the work that delayed the canary (or ran its
  // short lease out in the queue) has just drained.
  if (previous >= 0 && progress > previous) return true;
  return has_work && previous < 0;
}

}  // namespace pdserve::router
