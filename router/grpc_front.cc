#include "router/grpc_front.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/api_keys.h"
#include "common/grpc_discovery.h"
#include "common/grpc_listener.h"
#include "common/host_port.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/grpc_request.h"
#include "spdlog/spdlog.h"

namespace pdserve::router {
namespace {

namespace pv1 = pdserve::v1;

// How often grpc.health.v1 re-reads the router's readiness.
constexpr absl::Duration kHealthPeriod = absl::Milliseconds(200);

grpc::StatusCode CodeFor(int http_status) {
  switch (http_status) {
    case 400:
    case 413:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case 401:
      return grpc::StatusCode::UNAUTHENTICATED;
    case 404:
      return grpc::StatusCode::NOT_FOUND;
    case 429:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case 503:
      return grpc::StatusCode::UNAVAILABLE;
    default:
      return grpc::StatusCode::INTERNAL;
  }
}

grpc::Status ToStatus(const frontend::ApiError& error) {
  return grpc::Status(CodeFor(error.http_status), error.ToJson());
}

// Generate is served raw (its request and responses as bytes) so that a request that does not
// parse gets INVALID_ARGUMENT with the OpenAI error JSON: gRPC's typed callback handler answers
// UNIMPLEMENTED with no message, which reads as "no such method".
using Bytes = grpc::ByteBuffer;

Bytes Serialize(const pv1::GenerateResponse& response) {
  Bytes out;
  bool own_buffer = false;
  // Fails only for a message over 2 GiB; a delta is far smaller.
  if (!grpc::SerializationTraits<pv1::GenerateResponse>::Serialize(response, &out, &own_buffer)
           .ok()) {
    spdlog::error("gRPC front: response {} did not serialize", response.id());
  }
  return out;
}

// Runs `f` once, soon, on a gRPC executor thread: for work that must not run on the thread that
// decides it (a sink callback may hold the service's locks that Generation::Cancel takes).
void RunOnGrpcThread(std::function<void()> f) {
  auto* alarm = new grpc::Alarm();
  alarm->Set(std::chrono::system_clock::now(), [alarm, f = std::move(f)](bool) {
    f();
    delete alarm;  // the alarm holds its own reference until this callback returns
  });
}

// Shared by a call's reactor and its sink: the messages waiting to be written and the end.
struct CallState {
  CallState(frontend::GenerationService* s, const GrpcStreamOptions& o) : service(s), options(o) {}

  absl::Mutex mu;
  grpc::ServerWriteReactor<Bytes>* reactor ABSL_GUARDED_BY(mu) = nullptr;
  std::deque<Bytes> queue ABSL_GUARDED_BY(mu);  // serialized pv1::GenerateResponse
  size_t queued_bytes ABSL_GUARDED_BY(mu) = 0;  // of `queue`, the write in progress included
  // The last write that completed (the call's start before any): how a client's reading shows.
  absl::Time last_progress ABSL_GUARDED_BY(mu) = absl::Now();
  bool writing ABSL_GUARDED_BY(mu) = false;
  std::optional<grpc::Status> end ABSL_GUARDED_BY(mu);
  bool finished ABSL_GUARDED_BY(mu) = false;     // Finish() was called (exactly once per call)
  bool cancelled ABSL_GUARDED_BY(mu) = false;    // the client cancelled or its deadline passed
  bool ended_early ABSL_GUARDED_BY(mu) = false;  // EndEarly: a slow client or the shutdown
  std::shared_ptr<frontend::Generation> generation ABSL_GUARDED_BY(mu);
  std::string id;
  frontend::GenerationService* const service;
  frontend::Endpoint endpoint = frontend::Endpoint::kCompletions;  // set before the sink runs
  const GrpcStreamOptions options;

  // Calls Finish(status) unless it was called already. Every call is finished exactly once:
  // normally by Pump, or with CANCELLED by a cancellation / failed write.
  void FinishOnce(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (reactor == nullptr || finished) return;
    finished = true;
    reactor->Finish(status);
  }

  // Starts the next write, or finishes once the queue is empty and the end is known.
  void Pump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (reactor == nullptr || writing || finished) return;
    if (cancelled) {
      FinishOnce(grpc::Status::CANCELLED);
      return;
    }
    if (!queue.empty()) {
      writing = true;
      reactor->StartWrite(&queue.front());
      return;
    }
    if (end) FinishOnce(*end);
  }

  // Queues one message unless the call is over; past options.stream_queue_bytes, ends a call
  // whose client is not keeping up (GrpcStreamOptions).
  void Push(Bytes bytes, std::optional<grpc::Status> then) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (finished || ended_early) return;
    queued_bytes += bytes.Length();
    queue.push_back(std::move(bytes));
    if (then) end = std::move(then);
    if (queued_bytes > options.stream_queue_bytes) {
      const absl::Duration idle = absl::Now() - last_progress;
      if (idle >= options.stall_timeout) {
        return EndSlow(frontend::StreamStalled(absl::ToInt64Milliseconds(idle)));
      }
      if (queued_bytes > std::max(options.max_stream_queue_bytes, options.stream_queue_bytes)) {
        return EndSlow(frontend::StreamTooSlow(queued_bytes));
      }
    }
    Pump();
  }

  // Ends the call with `error` for a client that does not keep up (counted and logged).
  void EndSlow(const frontend::ApiError& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    spdlog::warn("gRPC front: ending {}: {} ({} bytes queued)", id, error.message, queued_bytes);
    service->RecordStreamEnded(endpoint, frontend::Front::kGrpc, error.code);
    EndEarly(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, error.ToJson()));
  }

  // Drops the messages not yet started (the write in progress completes when the client reads
  // it), ends the call with `status` (its trailers follow that write) and cancels the generation
  // from a gRPC thread.
  void EndEarly(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ended_early = true;
    const size_t keep = writing ? 1 : 0;
    while (queue.size() > keep) {
      queued_bytes -= queue.back().Length();
      queue.pop_back();
    }
    FinishOnce(status);
    RunOnGrpcThread([weak = std::weak_ptr<frontend::Generation>(generation)] {
      if (auto g = weak.lock()) g->Cancel();
    });
  }
};

// The Generate calls not done yet, for GrpcFront::Drain; `draining` refuses new ones.
struct LiveCalls {
  absl::Mutex mu;
  std::set<std::shared_ptr<CallState>> calls ABSL_GUARDED_BY(mu);
  bool draining ABSL_GUARDED_BY(mu) = false;
};

class Sink : public frontend::GenerationSink {
 public:
  explicit Sink(std::shared_ptr<CallState> state) : state_(std::move(state)) {}
  void OnDelta(frontend::ChoiceDelta delta) override {
    pv1::GenerateResponse response;
    response.set_id(state_->id);
    pv1::ChoiceDelta* out = response.add_choices();
    out->set_index(delta.index);
    out->set_text(delta.text);
    out->set_reasoning(delta.reasoning);
    for (const frontend::ToolCallDelta& call : delta.tool_calls) {
      pv1::ToolCall* c = out->add_tool_calls();
      c->set_id(call.id);
      c->set_name(call.name);
      c->set_arguments(call.arguments);
      c->set_index(call.index);
    }
    for (const frontend::TokenLogprob& lp : delta.logprobs) {
      pv1::TokenLogprob* t = out->add_logprobs();
      t->set_token(lp.token);
      t->set_logprob(lp.logprob);
      for (const auto& [token, logprob] : lp.top) {
        pv1::TopLogprob* top = t->add_top_logprobs();
        top->set_token(token);
        top->set_logprob(logprob);
      }
    }
    if (delta.finish_reason) out->set_finish_reason(*delta.finish_reason);
    if (delta.degeneration_kind) {
      out->set_degenerate(true);
      out->set_degeneration_kind(*delta.degeneration_kind);
    }
    Bytes bytes = Serialize(response);
    absl::MutexLock lock(&state_->mu);
    state_->Push(std::move(bytes), std::nullopt);
  }
  void OnComplete(frontend::Usage usage) override {
    pv1::GenerateResponse response;
    response.set_id(state_->id);
    response.mutable_usage()->set_prompt_tokens(usage.prompt_tokens);
    response.mutable_usage()->set_completion_tokens(usage.completion_tokens);
    response.mutable_usage()->set_reasoning_tokens(usage.reasoning_tokens);
    Bytes bytes = Serialize(response);
    absl::MutexLock lock(&state_->mu);
    state_->Push(std::move(bytes), grpc::Status::OK);
  }
  void OnError(frontend::ApiError error) override {
    absl::MutexLock lock(&state_->mu);
    state_->end = ToStatus(error);
    state_->Pump();
  }

 private:
  std::shared_ptr<CallState> state_;
};

class GenerateReactor : public grpc::ServerWriteReactor<Bytes> {
 public:
  GenerateReactor(frontend::GenerationService* service, const GrpcStreamOptions& options,
                  const Bytes& request_bytes, LiveCalls* live)
      : state_(std::make_shared<CallState>(service, options)), live_(live) {
    state_->id = frontend::NewResponseId(frontend::Endpoint::kCompletions);
    {
      absl::MutexLock lock(&state_->mu);
      state_->reactor = this;
    }
    bool draining = false;
    {
      absl::MutexLock lock(&live_->mu);
      draining = live_->draining;
      live_->calls.insert(state_);  // until OnDone, also when refused below
    }
    if (draining) {
      service->RecordRejected(frontend::Endpoint::kCompletions, frontend::Front::kGrpc, 503);
      End(ToStatus(frontend::ShuttingDown()));
      return;
    }
    pv1::GenerateRequest request;
    Bytes copy(request_bytes);  // Deserialize consumes its buffer; the copy shares the slices
    if (!grpc::SerializationTraits<pv1::GenerateRequest>::Deserialize(&copy, &request).ok()) {
      // Counted like every other refused request (the endpoint is the gRPC method's either way).
      service->RecordRejected(frontend::Endpoint::kCompletions, frontend::Front::kGrpc, 400);
      End(ToStatus(frontend::InvalidRequest(
          "the request is not a pdserve.v1.GenerateRequest (malformed protobuf, or a string "
          "field that is not UTF-8)")));
      return;
    }
    frontend::Endpoint endpoint;
    frontend::ParsedRequest parsed = ParseGenerateRequest(request, &endpoint);
    if (auto* error = std::get_if<frontend::ApiError>(&parsed)) {
      service->RecordRejected(endpoint, frontend::Front::kGrpc, error->http_status);
      End(ToStatus(*error));
      return;
    }
    const frontend::ApiRequest& api = std::get<frontend::ApiRequest>(parsed);
    state_->endpoint = endpoint;
    const std::vector<std::string> names = service->ModelNames();
    if (std::find(names.begin(), names.end(), api.model) == names.end()) {
      frontend::ApiError e = frontend::ModelNotFound(api.model);
      service->RecordRejected(endpoint, frontend::Front::kGrpc, e.http_status);
      End(ToStatus(e));
      return;
    }
    frontend::StartResult started = service->Start(api, std::make_shared<Sink>(state_));
    if (auto* error = std::get_if<frontend::ApiError>(&started)) {
      End(ToStatus(*error));
      return;
    }
    std::shared_ptr<frontend::Generation> generation =
        std::move(std::get<std::unique_ptr<frontend::Generation>>(started));
    bool ended_early = false;
    {
      absl::MutexLock lock(&state_->mu);
      state_->generation = generation;
      ended_early = state_->ended_early;
    }
    // Ended while Start() ran (a slow client, the drain): EndEarly had no generation to cancel.
    if (ended_early) generation->Cancel();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&state_->mu);
    state_->writing = false;
    state_->queued_bytes -= state_->queue.front().Length();
    state_->queue.pop_front();
    if (ok) state_->last_progress = absl::Now();
    if (!ok) {
      state_->FinishOnce(grpc::Status::CANCELLED);
      return;
    }
    state_->Pump();
  }
  // The client cancelled (or its deadline passed): stop the generation and finish the call with
  // CANCELLED (now, or when the write in progress completes), so that OnDone runs and the call is
  // freed. gRPC calls OnCancel after the constructor returned, so the generation is settled.
  void OnCancel() override {
    std::shared_ptr<frontend::Generation> generation;
    {
      absl::MutexLock lock(&state_->mu);
      state_->cancelled = true;
      state_->Pump();  // finishes unless a write is in progress (its OnWriteDone finishes)
      generation = state_->generation;
    }
    if (generation) generation->Cancel();
  }
  // The call is over: the generation is cancelled and released here (the sink the service holds
  // keeps the state alive, and the generation must not wait for the service to drop it).
  void OnDone() override {
    std::shared_ptr<frontend::Generation> generation;
    {
      absl::MutexLock lock(&state_->mu);
      state_->reactor = nullptr;
      generation = std::move(state_->generation);
    }
    if (generation) generation->Cancel();
    {
      absl::MutexLock lock(&live_->mu);
      live_->calls.erase(state_);
    }
    delete this;
  }

 private:
  void End(grpc::Status status) {
    absl::MutexLock lock(&state_->mu);
    state_->end = std::move(status);
    state_->Pump();
  }

  std::shared_ptr<CallState> state_;
  LiveCalls* const live_;
};

// Ends a call at once with `status`, before anything of the request has run.
class RefusedWriteReactor final : public grpc::ServerWriteReactor<Bytes> {
 public:
  explicit RefusedWriteReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

class GenerationImpl final
    : public pv1::Generation::WithRawCallbackMethod_Generate<pv1::Generation::CallbackService> {
 public:
  GenerationImpl(frontend::GenerationService* service,
                 std::shared_ptr<const common::ApiKeys> api_keys, GrpcStreamOptions stream,
                 LiveCalls* live)
      : service_(service), api_keys_(std::move(api_keys)), stream_(stream), live_(live) {}
  grpc::ServerWriteReactor<Bytes>* Generate(grpc::CallbackServerContext* context,
                                            const Bytes* request) override {
    if (!Authorized(*context)) return new RefusedWriteReactor(ToStatus(frontend::InvalidApiKey()));
    return new GenerateReactor(service_, stream_, *request, live_);
  }
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const pv1::ListModelsRequest*,
                                       pv1::ListModelsResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!Authorized(*context)) {
      reactor->Finish(ToStatus(frontend::InvalidApiKey()));
      return reactor;
    }
    for (const std::string& name : service_->ListedModelNames()) response->add_models(name);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  // The call's `authorization` metadata names one of the keys (or the front has none).
  bool Authorized(const grpc::CallbackServerContext& context) const {
    if (!api_keys_) return true;
    const auto& metadata = context.client_metadata();
    const auto it = metadata.find("authorization");
    return it != metadata.end() &&
           api_keys_->Matches(std::string_view(it->second.data(), it->second.size()));
  }

  frontend::GenerationService* service_;
  std::shared_ptr<const common::ApiKeys> api_keys_;
  const GrpcStreamOptions stream_;
  LiveCalls* const live_;
};

}  // namespace

class GrpcFront::Impl {
 public:
  Impl(frontend::GenerationService* service, std::shared_ptr<const common::ApiKeys> api_keys,
       GrpcStreamOptions stream)
      : generation(service, std::move(api_keys), stream, &live) {}
  LiveCalls live;  // before `generation`, which points to it
  GenerationImpl generation;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<rpc::ServingFollower> health;  // stopped before the server
  std::unique_ptr<rpc::ServerDrain> drain;       // from StopServing on
};

absl::StatusOr<std::unique_ptr<GrpcFront>> GrpcFront::Start(
    const std::string& host, int port, frontend::GenerationService* service,
    std::shared_ptr<grpc::ServerCredentials> credentials,
    std::shared_ptr<const common::ApiKeys> api_keys, GrpcStreamOptions stream,
    const config::GrpcConfig& limits) {
  std::unique_ptr<GrpcFront> front(new GrpcFront());
  front->impl_ = std::make_unique<Impl>(service, std::move(api_keys), stream);
  rpc::EnableGrpcDiscovery();
  grpc::ServerBuilder builder;
  rpc::ApplyConnectionLimits(limits, builder);
  builder.AddListeningPort(common::HostPort(host, port),
                           credentials ? credentials : grpc::InsecureServerCredentials(),
                           &front->port_);
  builder.RegisterService(&front->impl_->generation);
  front->impl_->server = builder.BuildAndStart();
  if (!front->impl_->server || front->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve gRPC on ", common::HostPort(host, port)));
  }
  // grpc.health.v1 says SERVING while the router is ready (its /ready: enough healthy workers).
  front->impl_->health = std::make_unique<rpc::ServingFollower>(
      front->impl_->server.get(), std::vector<std::string>{pv1::Generation::service_full_name()},
      [service] { return service->Ready(); }, kHealthPeriod);
  return front;
}

GrpcFront::~GrpcFront() { Stop(); }

void GrpcFront::StopServing() {
  if (!impl_) return;
  if (impl_->health) impl_->health->Stop();
  {
    absl::MutexLock lock(&impl_->live.mu);
    impl_->live.draining = true;
  }
  if (impl_->server && !impl_->drain) {
    impl_->drain = std::make_unique<rpc::ServerDrain>(impl_->server.get());
  }
}

void GrpcFront::Drain(std::chrono::milliseconds grace) {
  if (!impl_) return;
  StopServing();
  LiveCalls& live = impl_->live;
  std::vector<std::shared_ptr<CallState>> left;
  {
    absl::MutexLock lock(&live.mu);
    live.mu.AwaitWithTimeout(
        absl::Condition(
            +[](LiveCalls* l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(l->mu) { return l->calls.empty(); },
            &live),
        absl::FromChrono(grace));
    left.assign(live.calls.begin(), live.calls.end());
  }
  for (const std::shared_ptr<CallState>& state : left) {
    absl::MutexLock lock(&state->mu);
    state->EndEarly(ToStatus(frontend::ShuttingDown()));
  }
  if (!left.empty()) {
    spdlog::info("gRPC front: ended {} call(s) still running after the drain", left.size());
  }
}

void GrpcFront::Stop() {
  StopServing();
  if (impl_ && impl_->server) {
    impl_->drain->Finish(absl::Seconds(1));
    impl_->drain.reset();
    impl_->server.reset();
  }
}

}  // namespace pdserve::router
