// In-process fake prefill and decode workers (pdserve.worker.v1 over real gRPC on loopback) for
// the router's tests. The decode worker generates a deterministic token sequence:
//   token(i) = 100 + (seed + 7 * choice + 13 * i + prompt_tokens) % 300
// for i in [0, max_tokens), one token per event, then a final event with finish_reason "length"
// and no tokens. Knobs make it refuse Reserve, fail with an "error" event, or wait between
// tokens (cancellation tests). Everything it saw is recorded for assertions.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpc/grpc.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"

namespace pdserve::router::testing {

// gRPC 1.51 runs client callbacks on a shared "callback alternative" completion queue that is
// created with the first channel that makes a callback call and shut down with the last one;
// tests that create and drop channels one after another race that shutdown against the next
// creation and can abort in grpc_cq_internal_unref. A server process keeps its channels for its
// lifetime; tests call this first so one channel holds the queue for the whole binary.
inline void KeepCallbackQueueAlive() {
  static const bool kept = [] {
    grpc_init();
    static std::shared_ptr<grpc::Channel> channel =
        grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials());
    static auto stub = worker::v1::DecodeWorker::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(10));
    worker::v1::HealthRequest request;
    worker::v1::HealthResponse response;
    absl::Mutex mu;
    bool done = false;
    stub->async()->Health(&context, &request, &response, [&](grpc::Status) {
      absl::MutexLock lock(&mu);
      done = true;
    });
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));
    return true;
  }();
  (void)kept;
}

inline int32_t FakeToken(uint64_t seed, uint32_t choice, int i, int prompt_tokens) {
  return 100 + static_cast<int32_t>((seed + 7 * choice + 13 * static_cast<uint64_t>(i) +
                                     static_cast<uint64_t>(prompt_tokens)) %
                                    300);
}

class FakeDecode final : public worker::v1::DecodeWorker::Service {
 public:
  grpc::StatusCode reserve_code = grpc::StatusCode::OK;  // != OK: Reserve fails with it
  std::string reserve_message = "fake refuses";          // ... and this message
  bool fail_with_error_event = false;
  // The third event is a final "abort" with this message (a decode worker whose drain timeout
  // passed: "worker shutting down"); empty: no such event.
  std::string abort_message;
  bool lease_error_first = false;  // the first event is an "error" with ISOLATION_ERROR_LEASE
  int token_delay_ms = 0;
  // > 0: Generate sends its first event only after this long, or ends as soon as its call is
  // cancelled, as a real decode worker waits for the transfer before its first token.
  int generate_wait_ms = 0;
  int reserve_delay_ms = 0;  // > 0: Reserve answers this late (after its work is done)
  // >= 0: the events of tokens from this index on say degenerate, with this kind ("" as a
  // worker that predates GenerateResponse.degeneration_kind).
  int degenerate_from = -1;
  std::string degeneration_kind = "repeat";
  worker::v1::HealthResponse::State state = worker::v1::HealthResponse::STATE_SERVING;
  int64_t max_batch = 0;  // HealthResponse.max_batch (0: not stated)
  // HealthResponse's model identity (empty / 0: not stated), and the model_fingerprint the
  // tickets state (0: none).
  std::string model;
  uint64_t model_fingerprint = 0;
  std::string page_geometry;
  uint64_t ticket_fingerprint = 0;
  // Health answers only once its call is cancelled (or after 60 s), as a SIGSTOPped worker
  // whose connection stays open; health_calls counts the calls that arrived.
  bool health_hangs = false;
  std::atomic<int> health_calls{0};
  // >= 0: at most this many requests hold a reservation (from Reserve until their Generate
  // ends or they are aborted); Reserve beyond answers RESOURCE_EXHAUSTED, as a full worker.
  int slots = -1;
  // The next this many successful Reserves are forgotten as soon as they answered, as by a
  // decode worker replaced on its port between a Reserve and its Generate (the replacement's
  // Generate answers NOT_FOUND, below).
  int forget_reservations = 0;

  grpc::Status Reserve(grpc::ServerContext*, const worker::v1::ReserveRequest* request,
                       worker::v1::ReserveResponse* response) override {
    if (reserve_delay_ms > 0) absl::SleepFor(absl::Milliseconds(reserve_delay_ms));
    absl::MutexLock lock(&mu);
    reserves.push_back(*request);
    if (reserve_code != grpc::StatusCode::OK) return grpc::Status(reserve_code, reserve_message);
    // A shared reservation (choice_count n > 1) takes n slots; fork k streams as id + k.
    const int n = static_cast<int>(std::max<uint32_t>(1, request->sampling().choice_count()));
    if (slots >= 0 && static_cast<int>(holding.size()) + n > slots) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no free batch slot (fake)");
    }
    admitted.push_back(request->request_id());
    response->mutable_ticket()->set_ticket_id(++next_ticket);
    response->mutable_ticket()->set_request_id(request->request_id());
    response->mutable_ticket()->set_model_fingerprint(ticket_fingerprint);
    for (int k = 0; k < n; ++k) {
      worker::v1::ReserveRequest fork = *request;
      fork.mutable_sampling()->set_choice(request->sampling().choice() + static_cast<uint32_t>(k));
      fork.mutable_sampling()->clear_choice_count();
      holding.insert(request->request_id() + static_cast<uint64_t>(k));
      reserved[request->request_id() + static_cast<uint64_t>(k)] = fork;
    }
    if (forget_reservations > 0) {
      --forget_reservations;
      for (int k = 0; k < n; ++k) {
        holding.erase(request->request_id() + static_cast<uint64_t>(k));
        reserved.erase(request->request_id() + static_cast<uint64_t>(k));
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext* context, const worker::v1::GenerateRequest* request,
                        grpc::ServerWriter<worker::v1::GenerateResponse>* writer) override {
    worker::v1::ReserveRequest r;
    {
      absl::MutexLock lock(&mu);
      auto it = reserved.find(request->request_id());
      if (it == reserved.end()) {  // as the real decode worker answers
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("request ", request->request_id(), " has no reservation"));
      }
      r = it->second;
    }
    // The slot frees when the stream ends, whichever way.
    struct Release {
      FakeDecode* self;
      uint64_t id;
      ~Release() {
        absl::MutexLock lock(&self->mu);
        self->holding.erase(id);
      }
    } release{this, request->request_id()};
    const worker::v1::SamplingParams& s = r.sampling();
    for (int waited = 0; waited < generate_wait_ms; waited += 5) {
      if (context->IsCancelled()) return grpc::Status::CANCELLED;
      absl::SleepFor(absl::Milliseconds(5));
    }
    if (lease_error_first) {
      worker::v1::GenerateResponse error;
      error.set_finish_reason("error");
      error.set_isolation_error(worker::v1::ISOLATION_ERROR_LEASE);
      error.set_error_message("lease expired before the commit");
      writer->Write(error);
      return grpc::Status::OK;
    }
    for (int i = 0; i < s.max_tokens(); ++i) {
      if (!abort_message.empty() && i == 2) {
        worker::v1::GenerateResponse abort;
        abort.set_finish_reason("abort");
        abort.set_error_message(abort_message);
        writer->Write(abort);
        return grpc::Status::OK;
      }
      if (fail_with_error_event && i == 2) {
        worker::v1::GenerateResponse error;
        error.set_finish_reason("error");
        error.set_isolation_error(worker::v1::ISOLATION_ERROR_CHECKSUM);
        error.set_error_message("page 3 checksum mismatch");
        writer->Write(error);
        return grpc::Status::OK;
      }
      if (token_delay_ms > 0) {
        for (int w = 0; w < token_delay_ms / 5; ++w) {
          if (context->IsCancelled() || Aborted(request->request_id())) break;
          absl::SleepFor(absl::Milliseconds(5));
        }
      }
      if (context->IsCancelled() || Aborted(request->request_id())) {
        worker::v1::GenerateResponse abort;
        abort.set_finish_reason("abort");
        writer->Write(abort);
        return grpc::Status::OK;
      }
      worker::v1::GenerateResponse event;
      const int32_t token = FakeToken(s.seed(), s.choice(), i, r.prompt_tokens());
      event.add_token_ids(token);
      if (degenerate_from >= 0 && i >= degenerate_from) {
        event.set_degenerate(true);
        event.set_degeneration_kind(degeneration_kind);
      }
      if (s.has_logprobs()) {
        worker::v1::SampledToken* t = event.add_tokens();
        t->set_token_id(token);
        // As the real decode worker: the first token (the commit's) carries only its id; its
        // logprobs are in PrefillResponse.first_token.
        if (i == 0) {
          if (!writer->Write(event)) return grpc::Status::OK;
          continue;
        }
        t->set_logprob(-0.5f);
        for (int k = 0; k < s.logprobs(); ++k) {
          worker::v1::TokenLogprob* top = t->add_top_logprobs();
          top->set_token_id(token + k);
          top->set_logprob(-0.5f - static_cast<float>(k));
        }
      }
      if (!writer->Write(event)) return grpc::Status::OK;
    }
    worker::v1::GenerateResponse last;
    last.set_finish_reason("length");
    writer->Write(last);
    return grpc::Status::OK;
  }

  grpc::Status Abort(grpc::ServerContext*, const worker::v1::AbortRequest* request,
                     worker::v1::AbortResponse* response) override {
    absl::MutexLock lock(&mu);
    abort_requests.push_back(*request);
    for (uint32_t k = 0; k < std::max<uint32_t>(1, request->choice_count()); ++k) {
      aborts.push_back(request->request_id() + k);
      holding.erase(request->request_id() + k);
    }
    response->set_quiesced(true);
    return grpc::Status::OK;
  }
  grpc::Status Stats(grpc::ServerContext*, const worker::v1::StatsRequest*,
                     worker::v1::StatsResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status Health(grpc::ServerContext* context, const worker::v1::HealthRequest*,
                      worker::v1::HealthResponse* response) override {
    health_calls.fetch_add(1);
    if (health_hangs) {
      const absl::Time until = absl::Now() + absl::Seconds(60);
      while (!context->IsCancelled() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
      return grpc::Status::CANCELLED;
    }
    response->set_state(state);
    response->set_role("decode");
    response->set_max_batch(max_batch);
    response->set_model(model);
    response->set_model_fingerprint(model_fingerprint);
    response->set_page_geometry(page_geometry);
    return grpc::Status::OK;
  }

  bool Aborted(uint64_t id) {
    absl::MutexLock lock(&mu);
    for (uint64_t a : aborts) {
      if (a == id) return true;
    }
    return false;
  }

  absl::Mutex mu;
  uint64_t next_ticket = 0;
  std::vector<worker::v1::ReserveRequest> reserves;
  std::map<uint64_t, worker::v1::ReserveRequest> reserved;
  std::vector<uint64_t> aborts;
  std::vector<worker::v1::AbortRequest> abort_requests;
  std::set<uint64_t> holding;      // requests holding a slot (see `slots`)
  std::vector<uint64_t> admitted;  // request ids in the order their Reserve succeeded
};

class FakePrefill final : public worker::v1::PrefillWorker::Service {
 public:
  grpc::StatusCode prefill_code = grpc::StatusCode::OK;
  // The first `fail_first` Prefill calls fail with `fail_code` and error details `fail_details`
  // (worker/transfer_peer.h's marker: the transfer to the decode worker failed).
  int fail_first = 0;
  grpc::StatusCode fail_code = grpc::StatusCode::UNAVAILABLE;
  std::string fail_details;
  int delay_ms = 0;  // > 0: Prefill answers this late (after Generate's first events), or
                     // CANCELLED as soon as its call is cancelled
  // != 0: a ticket stating another model_fingerprint is refused as the real prefill worker
  // refuses one (FAILED_PRECONDITION, error details worker::kTicketMismatch's text).
  uint64_t accepted_ticket_fingerprint = 0;
  std::string mismatch_message = "the ticket names 11 pages; a prompt of 4 tokens has 17 (fake)";
  // HealthResponse's model identity (empty / 0: not stated).
  std::string model;
  uint64_t model_fingerprint = 0;
  std::string page_geometry;
  // HealthResponse.cuda_ipc (unset: host pages only).
  std::optional<worker::v1::CudaIpcSource> cuda_ipc;

  grpc::Status Prefill(grpc::ServerContext* context, const worker::v1::PrefillRequest* request,
                       worker::v1::PrefillResponse* response) override {
    for (int waited = 0; waited < delay_ms; waited += 5) {
      if (context->IsCancelled()) {
        absl::MutexLock lock(&mu);
        cancelled.push_back(request->request_id());
        return grpc::Status(grpc::StatusCode::CANCELLED, "the router cancelled the prefill");
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    absl::MutexLock lock(&mu);
    prefills.push_back(*request);
    if (fail_first > 0) {
      --fail_first;
      return grpc::Status(fail_code, "fake transfer failure", fail_details);
    }
    if (prefill_code != grpc::StatusCode::OK) return grpc::Status(prefill_code, "fake prefill");
    if (accepted_ticket_fingerprint != 0 &&
        request->ticket().model_fingerprint() != accepted_ticket_fingerprint) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, mismatch_message,
                          "pdserve.worker.v1/ticket_mismatch");
    }
    response->mutable_commit()->set_ticket_id(request->ticket().ticket_id());
    response->mutable_commit()->set_prompt_tokens(request->token_ids_size());
    // The first token as the decode worker streams it, with logprob -0.25 and top_logprobs
    // (token + k, -0.25 - k) when logprobs are requested.
    const worker::v1::SamplingParams& s = request->sampling();
    const int32_t token = FakeToken(s.seed(), s.choice(), 0, request->token_ids_size());
    response->mutable_commit()->set_first_token(token);
    worker::v1::SampledToken* first = response->mutable_first_token();
    first->set_token_id(token);
    first->set_logprob(s.has_logprobs() ? -0.25f : 0.0f);
    for (int k = 0; k < s.logprobs(); ++k) {
      worker::v1::TokenLogprob* top = first->add_top_logprobs();
      top->set_token_id(token + k);
      top->set_logprob(-0.25f - static_cast<float>(k));
    }
    // A shared prefill's other choices, each from its own stream, as the real prefill worker.
    for (uint32_t c = 1; c < s.choice_count(); ++c) {
      worker::v1::SampledToken* more = response->add_more_first_tokens();
      *more = *first;
      const int32_t other = FakeToken(s.seed(), s.choice() + c, 0, request->token_ids_size());
      more->set_token_id(other);
      for (int k = 0; k < more->top_logprobs_size(); ++k) {
        more->mutable_top_logprobs(k)->set_token_id(other + k);
      }
      response->mutable_commit()->add_more_first_tokens(other);
    }
    return grpc::Status::OK;
  }
  grpc::Status Abort(grpc::ServerContext*, const worker::v1::AbortRequest* request,
                     worker::v1::AbortResponse* response) override {
    absl::MutexLock lock(&mu);
    aborts.push_back(request->request_id());
    response->set_quiesced(true);
    return grpc::Status::OK;
  }
  grpc::Status Stats(grpc::ServerContext*, const worker::v1::StatsRequest*,
                     worker::v1::StatsResponse* response) override {
    absl::MutexLock lock(&mu);
    stats_transfer_bytes += stats_bytes_per_call;
    stats_prefilled_tokens += stats_tokens_per_call;
    stats_forward_layers += stats_layers_per_call;
    response->set_waiting_requests(stats_waiting);
    response->set_transfer_bytes(stats_transfer_bytes);
    response->set_prefilled_tokens(stats_prefilled_tokens);
    response->set_forward_layers(stats_forward_layers);
    return grpc::Status::OK;
  }
  int32_t stats_waiting = 0;          // Stats' waiting_requests
  int64_t stats_bytes_per_call = 0;   // Stats' transfer_bytes grows this much per call
  int64_t stats_tokens_per_call = 0;  // Stats' prefilled_tokens grows this much per call
  int64_t stats_layers_per_call = 0;  // Stats' forward_layers grows this much per call
  int64_t stats_transfer_bytes = 0;
  int64_t stats_prefilled_tokens = 0;
  int64_t stats_forward_layers = 0;
  grpc::Status Health(grpc::ServerContext*, const worker::v1::HealthRequest*,
                      worker::v1::HealthResponse* response) override {
    response->set_state(state);
    response->set_role("prefill");
    response->set_model(model);
    response->set_model_fingerprint(model_fingerprint);
    response->set_page_geometry(page_geometry);
    if (cuda_ipc.has_value()) *response->mutable_cuda_ipc() = *cuda_ipc;
    return grpc::Status::OK;
  }
  worker::v1::HealthResponse::State state = worker::v1::HealthResponse::STATE_SERVING;

  absl::Mutex mu;
  std::vector<worker::v1::PrefillRequest> prefills;
  std::vector<uint64_t> aborts;
  std::vector<uint64_t> cancelled;  // Prefills that saw their call cancelled while delayed
};

// A gRPC server on a free loopback port serving one fake.
class FakeServer {
 public:
  // `port` 0: a free one.
  explicit FakeServer(grpc::Service* service, int port = 0) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
  }
  ~FakeServer() { server_->Shutdown(std::chrono::system_clock::now()); }
  int port() const { return port_; }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace pdserve::router::testing
