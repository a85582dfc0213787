#include "router/service.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/model_fingerprint.h"
#include "common/status.h"
#include "common/tls_credentials.h"
#include "router/request.h"

namespace pdserve::router {
namespace {

// The `endpoint` label of the request metrics: the HTTP endpoint, or for every gRPC request the
// method's full name (one method serves text and chat prompts), so the fronts count apart.
std::string EndpointLabel(frontend::Endpoint endpoint, frontend::Front front) {
  if (front == frontend::Front::kGrpc) return "pdserve.v1.Generation/Generate";
  return endpoint == frontend::Endpoint::kCompletions ? "completions" : "chat_completions";
}

}  // namespace

class RouterService::RouterGeneration : public frontend::Generation {
 public:
  explicit RouterGeneration(std::shared_ptr<Request> request) : request_(std::move(request)) {}
  ~RouterGeneration() override { Cancel(); }
  void Cancel() override {
    if (request_->cancelled.exchange(true)) return;
    Actions actions;
    {
      absl::MutexLock lock(&request_->mu);
      if (!request_->ended) {
        request_->ended = true;
        request_->service->RecordFinish(*request_, 499, "cancelled");
      }
      request_->Unqueue("cancelled", &actions);
      request_->AbortAll(&actions);
    }
    RunActions(actions);
  }

 private:
  std::shared_ptr<Request> request_;
};

absl::StatusOr<RouterOptions> OptionsFromConfig(const config::DeployConfig& config) {
  RouterOptions o;
  o.model_dir = config.model_path;
  o.served_name = config.served_name;
  o.prefill = config.prefill;
  o.decode = config.decode;
  PDSERVE_ASSIGN_OR_RETURN(o.prefill_policy, ParsePolicy(config.router.prefill_policy));
  PDSERVE_ASSIGN_OR_RETURN(o.decode_policy, ParsePolicy(config.router.decode_policy));
  o.health_interval = absl::Milliseconds(config.router.health_interval_ms);
  o.health_timeout = absl::Milliseconds(config.router.health_timeout_ms);
  o.lease_ms = config.lease_ms;
  o.prefill_timeout = absl::Milliseconds(config.router.prefill_timeout_ms);
  o.queue_timeout = absl::Milliseconds(config.router.queue_timeout_ms);
  o.max_prefills_per_worker = config.router.max_prefills_per_worker;
  PDSERVE_ASSIGN_OR_RETURN(o.worker_credentials,
                           common::ClusterChannelCredentials(config.security));
  return o;
}

absl::StatusOr<std::unique_ptr<RouterService>> RouterService::Create(const RouterOptions& options) {
  if (options.prefill.empty() || options.decode.empty()) {
    return absl::InvalidArgumentError(
        "the router needs at least one prefill and one decode worker");
  }
  std::unique_ptr<RouterService> s(new RouterService());
  s->options_ = options;
  PDSERVE_ASSIGN_OR_RETURN(s->preparer_, frontend::RequestPreparer::Load(options.model_dir));
  if (!options.served_name.empty()) s->model_names_.push_back(options.served_name);
  for (const std::string& name : s->preparer_->model_names()) s->model_names_.push_back(name);
  std::random_device random;
  s->id_base_ = (static_cast<uint64_t>(random()) << 32 | random()) & ~uint64_t{0xffffffff};
  s->prefill_policy_ = std::make_unique<Policy>(options.prefill_policy, options.prefix_load_cap);
  s->decode_policy_ = std::make_unique<Policy>(options.decode_policy, options.prefix_load_cap);

  auto& r = s->registry_;
  const std::vector<double> latency = metrics::LatencyBucketsSeconds();
  PDSERVE_RETURN_IF_ERROR(metrics::AddBuildInfo(r, "router"));
  PDSERVE_ASSIGN_OR_RETURN(s->requests_,
                           r.AddCounter("pdserve_router_requests_total", "Finished requests.",
                                        {"endpoint", "status", "finish_reason"}));
  PDSERVE_ASSIGN_OR_RETURN(
      s->ttft_, r.AddHistogram("pdserve_router_time_to_first_token_seconds",
                               "Request received to first token sent.", {"endpoint"}, latency));
  PDSERVE_ASSIGN_OR_RETURN(
      s->itl_, r.AddHistogram("pdserve_router_inter_token_latency_seconds",
                              "Gap between consecutive streamed tokens.", {"endpoint"}, latency));
  PDSERVE_ASSIGN_OR_RETURN(
      s->tpot_,
      r.AddHistogram("pdserve_router_time_per_output_token_seconds",
                     "Per request: (E2E - TTFT) / (output tokens - 1).", {"endpoint"}, latency));
  PDSERVE_ASSIGN_OR_RETURN(
      s->e2e_, r.AddHistogram("pdserve_router_e2e_request_latency_seconds",
                              "Request received to last token sent.", {"endpoint"}, latency));
  PDSERVE_ASSIGN_OR_RETURN(
      s->queue_time_,
      r.AddHistogram("pdserve_router_queue_time_seconds",
                     "Request received to every choice holding a decode reservation (the "
                     "admission queue included).",
                     {}, latency));
  PDSERVE_ASSIGN_OR_RETURN(s->queue_depth_,
                           r.AddGauge("pdserve_router_queue_depth",
                                      "Requests (their choices as one group) waiting in the "
                                      "admission queue for room on a decode "
                                      "worker."));
  PDSERVE_ASSIGN_OR_RETURN(
      s->queued_,
      r.AddCounter("pdserve_router_queued_total",
                   "Requests (their choices as one group) that found every decode worker "
                   "full and waited."));
  PDSERVE_ASSIGN_OR_RETURN(
      s->queue_wait_, r.AddHistogram("pdserve_router_queue_wait_seconds",
                                     "One choice's wait in the admission queue, by how it ended.",
                                     {"outcome"}, latency));
  PDSERVE_ASSIGN_OR_RETURN(s->prompt_tokens_, r.AddCounter("pdserve_router_prompt_tokens_total",
                                                           "Prompt tokens of accepted requests."));
  PDSERVE_ASSIGN_OR_RETURN(
      s->generation_tokens_,
      r.AddCounter("pdserve_router_generation_tokens_total", "Tokens streamed to clients."));
  PDSERVE_ASSIGN_OR_RETURN(
      s->requests_in_flight_,
      r.AddGauge("pdserve_router_requests_in_flight", "Requests between dispatch and completion."));
  PDSERVE_ASSIGN_OR_RETURN(
      s->retries_,
      r.AddCounter("pdserve_router_retries_total",
                   "Retries on another worker before any token was sent.", {"reason"}));
  PDSERVE_ASSIGN_OR_RETURN(
      s->slow_streams_,
      r.AddCounter("pdserve_router_slow_stream_ends_total",
                   "Streams ended early because the client did not keep up with them.",
                   {"endpoint", "reason"}));
  PDSERVE_ASSIGN_OR_RETURN(
      s->worker_up_,
      r.AddGauge("pdserve_router_worker_up",
                 "1 healthy, 0 marked down (canary or circuit breaker).", {"worker", "role"}));
  PDSERVE_ASSIGN_OR_RETURN(
      s->degenerate_,
      r.AddCounter("pdserve_router_degenerate_generations_total",
                   "Generations the degeneration detector caught.", {"kind", "action"}));

  // Series without labels exist from the start, so dashboards see 0 rather than no data.
  s->prompt_tokens_->Get();
  s->generation_tokens_->Get();
  s->requests_in_flight_->Get();
  s->queue_time_->Get();
  s->queue_depth_->Get();
  s->queued_->Get();
  // So do the labelled series alerts and dashboards read, so increase() sees the first event
  // (docs/metrics.md lists the values).
  const std::vector<std::string> endpoints = {
      EndpointLabel(frontend::Endpoint::kCompletions, frontend::Front::kHttp),
      EndpointLabel(frontend::Endpoint::kChatCompletions, frontend::Front::kHttp),
      EndpointLabel(frontend::Endpoint::kCompletions, frontend::Front::kGrpc)};
  for (auto* latency_family : {s->ttft_, s->itl_, s->tpot_, s->e2e_}) {
    latency_family->ExportAtZero({endpoints});
  }
  s->requests_->ExportAtZero({endpoints, {"200"}, {"stop", "length", "degenerate"}});
  s->requests_->ExportAtZero({endpoints, {"499"}, {"cancelled"}});
  s->requests_->ExportAtZero({endpoints, {"400", "429", "503"}, {"error"}});
  s->requests_->ExportAtZero({{"unknown"}, {"400", "408", "431"}, {"error"}});
  s->queue_wait_->ExportAtZero({{"admitted", "timeout", "cancelled"}});
  s->retries_->ExportAtZero({{"worker_down", "timeout", "prefill_busy"}});
  s->slow_streams_->ExportAtZero({endpoints, {"stream_stalled", "stream_too_slow"}});
  s->degenerate_->ExportAtZero({{"repeat", "whitespace", "empty", "unknown"}, {"flag", "stop"}});

  WorkerPoolOptions pool;
  pool.prefill = options.prefill;
  pool.decode = options.decode;
  pool.health_interval = options.health_interval;
  pool.down_retry = options.health_down_retry;
  pool.health_timeout = options.health_timeout;
  pool.canary_timeout = options.canary_timeout;
  pool.lease_ms = options.lease_ms;
  pool.background_checks = options.background_checks;
  pool.credentials = options.worker_credentials;
  pool.on_still_down = [raw = s.get()](Worker& w) {
    if (w.role() == Role::kDecode) {
      raw->CancelStalledStreams(w);
    } else {
      raw->CancelPrefillsOn(w);
    }
  };
  // The cluster's model identity as this router knows it: the name workers state (the served
  // name, else the directory's), and the fingerprint of the model directory when it holds the
  // weights (a router given only the config and tokenizer takes the first worker's).
  pool.expected.model =
      options.served_name.empty()
          ? std::filesystem::path(options.model_dir).lexically_normal().filename().string()
          : options.served_name;
  if (common::HasWeightsFiles(options.model_dir)) {
    PDSERVE_ASSIGN_OR_RETURN(pool.expected.fingerprint,
                             common::ModelFingerprint(options.model_dir));
  }
  if (options.canary) {
    PDSERVE_ASSIGN_OR_RETURN(pool.canary_prompt, s->preparer_->tokenizer().Encode("Hello"));
  }
  RouterService* raw = s.get();
  s->pool_ = std::make_unique<WorkerPool>(pool, [raw] { return raw->NextRequestId(); });
  if (options.queue_timeout > absl::ZeroDuration()) {
    s->queue_ = std::make_unique<AdmissionQueue>(options.queue);
  }
  return s;
}

RouterService::~RouterService() {
  // Outstanding calls hold their Request; wait until the workers' parts have all ended, so no
  // callback touches this service after it is gone. The Generations were cancelled by the
  // server's Stop() before the service is destroyed. The admission queue stops first: its
  // thread dispatches (the object stays until the members go: late calls into it are harmless).
  if (queue_ != nullptr) queue_->Stop();
  for (int i = 0; i < 1000 && (in_flight_.load() > 0 || calls_.load() > 0); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  pool_.reset();
}

std::vector<std::string> RouterService::ModelNames() const { return model_names_; }

std::vector<std::string> RouterService::ListedModelNames() const {
  std::vector<std::string> out;
  for (const std::string& name : model_names_) {
    if (name == options_.model_dir) continue;
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

void RouterService::RecordRejected(frontend::Endpoint endpoint, frontend::Front front,
                                   int http_status) {
  requests_->WithLabels({EndpointLabel(endpoint, front), absl::StrCat(http_status), "error"})
      .Increment();
}

void RouterService::RecordRefused(std::optional<frontend::Endpoint> endpoint, int http_status) {
  if (endpoint) return RecordRejected(*endpoint, frontend::Front::kHttp, http_status);
  requests_->WithLabels({"unknown", absl::StrCat(http_status), "error"}).Increment();
}

void RouterService::RecordStreamEnded(frontend::Endpoint endpoint, frontend::Front front,
                                      const std::string& reason) {
  slow_streams_->WithLabels({EndpointLabel(endpoint, front), reason}).Increment();
}

bool RouterService::Ready() const { return pool_->Ready(); }

std::optional<frontend::ApiError> RouterService::FanOutError(int n) const {
  int64_t widest = 0;
  std::vector<std::string> workers;
  for (const Worker* w : pool_->decode()) {
    if (w->max_batch() <= 0) return std::nullopt;  // not stated: no bound known
    widest = std::max(widest, w->max_batch());
    workers.push_back(absl::StrCat(w->name(), ": max_batch ", w->max_batch()));
  }
  if (n <= widest) return std::nullopt;
  return frontend::InvalidRequest(
      absl::StrCat("'n' is ", n, " but the choices share one prefill and decode together on one ",
                   "decode worker, and the widest runs at most ", widest, " sequences at once (",
                   absl::StrJoin(workers, ", "), ")"),
      "n");
}

frontend::ApiError RouterService::NoWorkerUpError(bool prefill, bool decode) const {
  std::vector<std::string> messages;
  bool mismatch = true;
  for (const auto& [down, role] : {std::pair{prefill, Role::kPrefill}, {decode, Role::kDecode}}) {
    if (!down) continue;
    WorkerPool::Unavailable why = pool_->NoWorkerUp(role);
    messages.push_back(std::move(why.message));
    mismatch = mismatch && why.mismatch;
  }
  if (messages.empty()) {  // came up since the caller looked
    return frontend::ServerError(503, "no prefill or decode worker is up", "server_error",
                                 "worker_unavailable");
  }
  return frontend::ServerError(503, absl::StrJoin(messages, "; "), "server_error",
                               mismatch ? "workers_incompatible" : "worker_unavailable");
}

void RouterService::RecordFinish(Request& request, int http_status,
                                 const std::string& finish_reason) {
  std::string reason = finish_reason;
  if (reason.empty()) {
    reason = "stop";
    for (const Choice& c : request.choices) {
      if (c.text.finish_reason() != "stop") reason = c.text.finish_reason();
    }
  }
  requests_->WithLabels({request.endpoint, absl::StrCat(http_status), reason}).Increment();
  if (request.dispatched) requests_in_flight_->Get().Add(-1);
  request.dispatched = false;
}

frontend::StartResult RouterService::Start(const frontend::ApiRequest& req,
                                           std::shared_ptr<frontend::GenerationSink> sink) {
  const std::string endpoint = EndpointLabel(req.endpoint, req.front);
  frontend::Prepared prepared = preparer_->Prepare(req);
  if (auto* error = std::get_if<frontend::ApiError>(&prepared)) {
    requests_->WithLabels({endpoint, absl::StrCat(error->http_status), "error"}).Increment();
    return *error;
  }
  auto request = std::make_shared<Request>();
  request->service = this;
  request->api = req;
  request->prepared = std::move(std::get<frontend::PreparedRequest>(prepared));
  request->sink = std::move(sink);
  request->endpoint = endpoint;
  request->received = absl::Now();
  serving::SamplingParams& params = request->prepared.params;
  // The seed is explicit on the wire: the one the colocated service would use for this id.
  params.seed = serving::EffectiveSeed(params, request->prepared.request_id);
  const int n = params.n;
  const int64_t queued = queue_ != nullptr ? queue_->size() : 0;
  if (in_flight_.load() + queued + n > options_.max_in_flight) {
    requests_->WithLabels({endpoint, "429", "error"}).Increment();
    return frontend::ServerError(429, "too many requests in flight; retry later",
                                 "rate_limit_exceeded");
  }
  if (!pool_->Ready()) {
    requests_->WithLabels({endpoint, "503", "error"}).Increment();
    bool prefill_up = false, decode_up = false;
    for (const Worker* w : pool_->prefill()) prefill_up |= w->up();
    for (const Worker* w : pool_->decode()) decode_up |= w->up();
    return NoWorkerUpError(!prefill_up, !decode_up);
  }
  if (std::optional<frontend::ApiError> wide = FanOutError(n)) {
    requests_->WithLabels({endpoint, "400", "error"}).Increment();
    return *wide;
  }
  {
    absl::MutexLock lock(&request->mu);
    request->choices.reserve(static_cast<size_t>(n));
    for (int c = 0; c < n; ++c) {
      request->choices.emplace_back(frontend::ChoiceText(*preparer_, req, c));
    }
    request->remaining = n;
    request->dispatched = true;
  }
  prompt_tokens_->Get().Increment(static_cast<double>(request->prepared.prompt.size()));
  requests_in_flight_->Get().Add(1);
  // First come first served: while requests wait for room, a new request waits behind them.
  // Its choices go as one group (one Reserve, one prefill; router/request.h).
  if (queued == 0) {
    Dispatch(request, 0, -1, -1);
  } else {
    Actions actions;
    {
      absl::MutexLock lock(&request->mu);
      if (!request->ended) Enqueue(*request, 0, &actions);
    }
    RunActions(actions);
  }
  return std::unique_ptr<frontend::Generation>(new RouterGeneration(request));
}

std::string RouterService::MetricsText() const {
  for (Worker* w : pool_->prefill()) {
    worker_up_->WithLabels({w->name(), "prefill"}).Set(w->up() ? 1 : 0);
  }
  for (Worker* w : pool_->decode()) {
    worker_up_->WithLabels({w->name(), "decode"}).Set(w->up() ? 1 : 0);
  }
  queue_depth_->Get().Set(queue_ != nullptr ? static_cast<double>(queue_->size()) : 0.0);
  return registry_.Serialize();
}

}  // namespace pdserve::router
