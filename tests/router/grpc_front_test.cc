// The gRPC front (pdserve.v1.Generation) over a scripted GenerationService: request mapping,
// streamed deltas and usage, and error statuses.
#include "router/grpc_front.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/service.h"
#include "tests/router/fake_workers.h"
#include "tests/router/generation_client.h"
#include "tests/router/promtool_check.h"

namespace pdserve::router {
namespace {

namespace pv1 = pdserve::v1;

// Answers every request with two deltas ("Hel", "lo" + finish "length") and usage {3, 2}, and
// remembers the request it got.
class ScriptedService : public frontend::GenerationService {
 public:
  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  frontend::StartResult Start(const frontend::ApiRequest& req,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    last = req;
    if (req.max_tokens && *req.max_tokens == 99) {
      frontend::ApiError e;
      e.http_status = 429;
      e.message = "full";
      return e;
    }
    sink->OnDelta({0, "Hel", {}, std::nullopt});
    sink->OnDelta({0, "lo", {}, std::string("length")});
    sink->OnComplete({3, 2});
    return std::unique_ptr<frontend::Generation>(new NoopGeneration());
  }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }
  frontend::ApiRequest last;

 private:
  class NoopGeneration : public frontend::Generation {
   public:
    void Cancel() override {}
  };
};

class GrpcFrontTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::KeepCallbackQueueAlive();
    auto front = GrpcFront::Start("127.0.0.1", 0, &service_);
    ASSERT_TRUE(front.ok()) << front.status();
    front_ = std::move(*front);
    stub_ = pv1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(front_->port()), grpc::InsecureChannelCredentials()));
  }

  grpc::Status Generate(const pv1::GenerateRequest& request,
                        std::vector<pv1::GenerateResponse>* out) {
    return testing::GenerateAll(*stub_, request, out);
  }

  ScriptedService service_;
  std::unique_ptr<GrpcFront> front_;
  std::unique_ptr<pv1::Generation::Stub> stub_;
};

TEST_F(GrpcFrontTest, StreamsDeltasThenUsage) {
  pv1::GenerateRequest request;
  request.set_model("tiny");
  request.set_text("And God said");
  request.set_max_tokens(2);
  request.set_seed(7);
  request.set_temperature(0.5);
  request.add_stop("\n");
  std::vector<pv1::GenerateResponse> out;
  ASSERT_TRUE(Generate(request, &out).ok());
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].choices(0).text(), "Hel");
  EXPECT_EQ(out[1].choices(0).text(), "lo");
  EXPECT_EQ(out[1].choices(0).finish_reason(), "length");
  EXPECT_EQ(out[2].usage().prompt_tokens(), 3);
  EXPECT_EQ(out[2].usage().completion_tokens(), 2);
  EXPECT_EQ(out[0].id(), out[2].id());
  EXPECT_EQ(*service_.last.prompt_text, "And God said");
  EXPECT_EQ(*service_.last.seed, 7u);
  EXPECT_DOUBLE_EQ(*service_.last.temperature, 0.5);
  EXPECT_EQ(service_.last.stop, std::vector<std::string>{"\n"});
  EXPECT_FALSE(service_.last.top_p.has_value());  // unset stays unset: model defaults apply
}

// A seed of 2^63 or more (uint64 on this API, int64 on HTTP) keys the generator with the same
// bits instead of failing as out of range.
TEST_F(GrpcFrontTest, SeedsAboveInt64MaxKeepTheirBits) {
  for (const uint64_t seed : {uint64_t{1} << 63, ~uint64_t{0}}) {
    pv1::GenerateRequest request;
    request.set_model("tiny");
    request.set_text("And God said");
    request.set_max_tokens(2);
    request.set_seed(seed);
    std::vector<pv1::GenerateResponse> out;
    const grpc::Status status = Generate(request, &out);
    ASSERT_TRUE(status.ok()) << seed << ": " << status.error_message();
    ASSERT_TRUE(service_.last.seed.has_value());
    EXPECT_EQ(*service_.last.seed, seed);
  }
}

TEST_F(GrpcFrontTest, ChatWithLogprobsMapsToTheChatEndpoint) {
  pv1::GenerateRequest request;
  request.set_model("tiny");
  pv1::ChatMessage* m = request.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("Hi");
  request.set_logprobs(3);
  std::vector<pv1::GenerateResponse> out;
  ASSERT_TRUE(Generate(request, &out).ok());
  EXPECT_EQ(service_.last.endpoint, frontend::Endpoint::kChatCompletions);
  EXPECT_TRUE(service_.last.logprobs);
  EXPECT_EQ(service_.last.top_logprobs, 3);
  ASSERT_EQ(service_.last.messages.size(), 1u);
  EXPECT_EQ(service_.last.messages[0].content, "Hi");
}

TEST_F(GrpcFrontTest, ErrorsAreStatusesWithTheOpenAiJson) {
  pv1::GenerateRequest request;
  request.set_model("nope");
  request.set_text("x");
  std::vector<pv1::GenerateResponse> out;
  grpc::Status status = Generate(request, &out);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(nlohmann::json::parse(status.error_message())["error"]["code"], "model_not_found");

  request.set_model("tiny");
  request.set_temperature(-1);
  status = Generate(request, &out);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(nlohmann::json::parse(status.error_message())["error"]["param"], "temperature");

  request.clear_temperature();
  request.set_max_tokens(99);
  status = Generate(request, &out);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(out.empty());
}

TEST_F(GrpcFrontTest, NonFiniteSamplingValuesAndThinkingOnTextAreInvalidArgument) {
  const double kNan = std::numeric_limits<double>::quiet_NaN();
  const double kInf = std::numeric_limits<double>::infinity();
  struct Case {
    std::string param;
    std::function<void(pv1::GenerateRequest&)> set;
  };
  const std::vector<Case> cases = {
      {"temperature", [&](pv1::GenerateRequest& r) { r.set_temperature(kNan); }},
      {"temperature", [&](pv1::GenerateRequest& r) { r.set_temperature(kInf); }},
      {"top_p", [&](pv1::GenerateRequest& r) { r.set_top_p(kNan); }},
      {"min_p", [&](pv1::GenerateRequest& r) { r.set_min_p(-kInf); }},
      {"presence_penalty", [&](pv1::GenerateRequest& r) { r.set_presence_penalty(kNan); }},
      {"frequency_penalty", [&](pv1::GenerateRequest& r) { r.set_frequency_penalty(kInf); }},
      {"repetition_penalty", [&](pv1::GenerateRequest& r) { r.set_repetition_penalty(kNan); }},
      {"logit_bias", [&](pv1::GenerateRequest& r) { (*r.mutable_logit_bias())[5] = kNan; }},
      {"thinking", [&](pv1::GenerateRequest& r) { r.set_thinking(true); }},
  };
  for (const Case& c : cases) {
    pv1::GenerateRequest request;
    request.set_model("tiny");
    request.set_text("And God said");
    c.set(request);
    std::vector<pv1::GenerateResponse> out;
    grpc::Status status = Generate(request, &out);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.param;
    EXPECT_EQ(nlohmann::json::parse(status.error_message())["error"]["param"], c.param);
    EXPECT_TRUE(out.empty());
  }
}

// One Generate call with `request` as raw bytes (what a client with another or a broken encoder
// sends), through gRPC's generic stub. Appends each response's bytes, parsed, to `out`.
grpc::Status RawGenerate(int port, const std::string& request,
                         std::vector<pv1::GenerateResponse>* out) {
  grpc::GenericStub stub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  void* tag = nullptr;
  bool ok = false;
  auto wait = [&] { return cq.Next(&tag, &ok) && ok; };
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, "/pdserve.v1.Generation/Generate", &cq);
  call->StartCall(nullptr);
  if (wait()) {
    grpc::Slice slice(request);
    grpc::ByteBuffer bytes(&slice, 1);
    call->WriteLast(bytes, grpc::WriteOptions(), nullptr);
    wait();
    grpc::ByteBuffer response;
    for (call->Read(&response, nullptr); wait(); call->Read(&response, nullptr)) {
      pv1::GenerateResponse parsed;
      EXPECT_TRUE(
          grpc::SerializationTraits<pv1::GenerateResponse>::Deserialize(&response, &parsed).ok());
      out->push_back(parsed);
    }
  }
  grpc::Status status;
  call->Finish(&status, nullptr);
  cq.Next(&tag, &ok);
  return status;
}

TEST_F(GrpcFrontTest, RequestsThatDoNotParseAreInvalidArgumentWithTheOpenAiJson) {
  pv1::GenerateRequest valid;
  valid.set_model("tiny");
  valid.set_text("x");
  std::vector<pv1::GenerateResponse> out;
  grpc::Status status = RawGenerate(front_->port(), valid.SerializeAsString(), &out);
  ASSERT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].choices(0).text(), "Hel");

  const std::string model = "\x0a\x04tiny";
  for (const std::string& bytes : {
           std::string("\x12\xff\xff\xff\xff\x0f", 6),  // text: a length past the end
           std::string("\x0f\x01", 2),                  // wire type 7 does not exist
           model + std::string("\x12\x03\xff\xfe"
                               "A",
                               5),  // text: not UTF-8
       }) {
    out.clear();
    status = RawGenerate(front_->port(), bytes, &out);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    const nlohmann::json error = nlohmann::json::parse(status.error_message(), nullptr, false);
    ASSERT_TRUE(error.is_object()) << status.error_message();
    EXPECT_EQ(error["error"]["type"], "invalid_request_error");
    EXPECT_TRUE(out.empty());
  }
}

// Starts every request and never ends it: the client has to cancel. Counts the generations
// cancelled and destroyed (the front destroys a call's generation when the call is done).
class HangingService : public frontend::GenerationService {
 public:
  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  frontend::StartResult Start(const frontend::ApiRequest&,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    sink->OnDelta({0, "Hel", {}, std::nullopt});
    absl::MutexLock lock(&mu);
    ++started;
    return std::unique_ptr<frontend::Generation>(new CountingGeneration(this));
  }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }

  absl::Mutex mu;
  int started ABSL_GUARDED_BY(mu) = 0;
  int cancelled ABSL_GUARDED_BY(mu) = 0;
  int destroyed ABSL_GUARDED_BY(mu) = 0;

 private:
  class CountingGeneration : public frontend::Generation {
   public:
    explicit CountingGeneration(HangingService* owner) : owner_(owner) {}
    ~CountingGeneration() override {
      absl::MutexLock lock(&owner_->mu);
      ++owner_->destroyed;
    }
    void Cancel() override {
      absl::MutexLock lock(&owner_->mu);
      if (!cancelled_) ++owner_->cancelled;
      cancelled_ = true;
    }

   private:
    HangingService* owner_;
    bool cancelled_ = false;
  };
};

// A front over a HangingService, and a stub to it.
class GrpcFrontCancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::KeepCallbackQueueAlive();
    auto started = GrpcFront::Start("127.0.0.1", 0, &service);
    ASSERT_TRUE(started.ok()) << started.status();
    front = std::move(*started);
    stub = pv1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(front->port()), grpc::InsecureChannelCredentials()));
  }
  HangingService service;
  std::unique_ptr<GrpcFront> front;
  std::unique_ptr<pv1::Generation::Stub> stub;
};

TEST_F(GrpcFrontCancelTest, CancelledCallsFinishAndTheFrontStops) {
  constexpr int kCalls = 20;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext context;
    pv1::GenerateRequest request;
    request.set_model("tiny");
    request.set_text("And God said");
    auto reader = stub->Generate(&context, request);
    pv1::GenerateResponse response;
    ASSERT_TRUE(reader->Read(&response));  // the call is running on the server
    EXPECT_EQ(response.choices(0).text(), "Hel");
    context.TryCancel();
    while (reader->Read(&response)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {
    // Every call is done on the server (OnDone freed it and its generation). The timeout only
    // bounds a failing run; the condition is what is asserted.
    absl::MutexLock lock(&service.mu);
    const bool all_done = service.mu.AwaitWithTimeout(
        absl::Condition(
            +[](HangingService* s)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->destroyed == kCalls; },
            &service),
        absl::Seconds(30));
    EXPECT_TRUE(all_done);
    EXPECT_EQ(service.started, kCalls);
    EXPECT_EQ(service.cancelled, kCalls);
    EXPECT_EQ(service.destroyed, kCalls);
  }
  // No call is left for the server's shutdown to wait on.
  front->Stop();
}

// Drain gives the calls in flight its grace, then ends them with UNAVAILABLE and the HTTP front's
// shutting_down error (the front's Stop alone cancels them: "Cancelling all calls"); calls that
// come meanwhile find the port closed (UNAVAILABLE) and never start.
class GrpcFrontDrainTest : public GrpcFrontCancelTest {
 protected:
  GrpcFrontDrainTest() {
    request.set_model("tiny");
    request.set_text("And God said");
  }
  // Starts a Generate call; true once its first message came (it runs on the server).
  bool StartCall() {
    reader = stub->Generate(&context, request);
    pv1::GenerateResponse response;
    return reader->Read(&response);
  }
  // Reads the call to its end: UNAVAILABLE with the HTTP front's shutting_down error.
  void ExpectEndedShuttingDown() {
    pv1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    const grpc::Status ended = reader->Finish();
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(nlohmann::json::parse(ended.error_message())["error"]["code"], "shutting_down")
        << ended.error_message();
  }

  pv1::GenerateRequest request;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<pv1::GenerateResponse>> reader;
};

TEST_F(GrpcFrontDrainTest, CallsStillRunningAfterTheGraceEndShuttingDown) {
  ASSERT_TRUE(StartCall());
  front->Drain(std::chrono::milliseconds(50));
  ExpectEndedShuttingDown();

  std::vector<pv1::GenerateResponse> out;
  const grpc::Status refused = testing::GenerateAll(*stub, request, &out);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_TRUE(out.empty());
  {
    absl::MutexLock lock(&service.mu);
    const bool cancelled = service.mu.AwaitWithTimeout(
        absl::Condition(
            +[](HangingService* s)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->cancelled == 1; },
            &service),
        absl::Seconds(30));
    EXPECT_TRUE(cancelled);
    EXPECT_EQ(service.started, 1);  // the call during the drain never started
  }
  front->Stop();
}

// From StopServing on the port is free: a replacement router's front binds it and serves new
// calls, while the draining front's call in flight goes on until its drain ends it.
TEST_F(GrpcFrontDrainTest, AReplacementBindsThePortWhileACallRuns) {
  ASSERT_TRUE(StartCall());
  const int port = front->port();
  front->StopServing();

  ScriptedService replacement_service;
  auto replacement = GrpcFront::Start("127.0.0.1", port, &replacement_service);
  ASSERT_TRUE(replacement.ok()) << replacement.status();
  EXPECT_EQ((*replacement)->port(), port);
  // A new client: its own connection (a channel that shared the draining one's could send a
  // call across its GOAWAY, which the draining server ends CANCELLED).
  grpc::ChannelArguments args;
  args.SetInt("grpc.use_local_subchannel_pool", 1);
  auto new_stub = pv1::Generation::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
  std::vector<pv1::GenerateResponse> out;
  const grpc::Status served = testing::GenerateAll(*new_stub, request, &out);
  EXPECT_TRUE(served.ok()) << served.error_message();
  ASSERT_EQ(out.size(), 3u);  // two deltas and the usage
  EXPECT_EQ(out[0].choices(0).text(), "Hel");

  front->Drain(std::chrono::milliseconds(50));
  ExpectEndedShuttingDown();
  front->Stop();
  (*replacement)->Stop();
}

// A RouterService over one fake prefill and one fake decode worker, its gRPC front and a stub.
class RouterFrontTest : public ::testing::Test {
 protected:
  void SetUp() override { testing::KeepCallbackQueueAlive(); }
  // Starts the router and its front (after the fakes' knobs are set).
  void StartRouter() {
    RouterOptions options;
    options.model_dir = PDSERVE_BUNDLED_MODEL;
    options.served_name = "tiny";
    options.prefill = {{"p0", "127.0.0.1", prefill_server_.port(), 0, "cpu"}};
    options.decode = {{"d0", "127.0.0.1", decode_server_.port(), 0, "cpu"}};
    options.canary = false;
    options.background_checks = false;
    auto service = RouterService::Create(options);
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = std::move(*service);
    service_->pool().CheckAll();
    auto front = GrpcFront::Start("127.0.0.1", 0, service_.get());
    ASSERT_TRUE(front.ok()) << front.status();
    front_ = std::move(*front);
    stub_ = pv1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(front_->port()), grpc::InsecureChannelCredentials()));
  }

  testing::FakeDecode decode_;
  testing::FakePrefill prefill_;
  testing::FakeServer decode_server_{&decode_}, prefill_server_{&prefill_};
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<GrpcFront> front_;
  std::unique_ptr<pv1::Generation::Stub> stub_;
};

TEST_F(RouterFrontTest, CancelledStreamsThroughTheRouterLeaveNothingInFlight) {
  decode_.token_delay_ms = 50;
  StartRouter();
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext context;
    pv1::GenerateRequest request;
    request.set_model("tiny");
    request.mutable_token_ids()->add_ids(5);
    request.mutable_token_ids()->add_ids(6);
    request.set_max_tokens(200);
    auto reader = stub_->Generate(&context, request);
    pv1::GenerateResponse response;
    // A token: the choice runs on the workers.
    ASSERT_TRUE(reader->Read(&response)) << reader->Finish().error_message();
    context.TryCancel();
    while (reader->Read(&response)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  front_->Stop();  // returns: no call is left open
  // Every worker request was aborted and its calls ended (the bound only limits a failing run).
  auto aborts = [&] {
    absl::MutexLock lock(&decode_.mu);
    return decode_.aborts.size();
  };
  for (int i = 0; i < 2000 && (service_->in_flight() != 0 || aborts() < 5); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(service_->in_flight(), 0);
  absl::MutexLock lock(&decode_.mu);
  EXPECT_EQ(decode_.reserves.size(), 5u);
  EXPECT_EQ(decode_.aborts.size(), 5u);
}

// gRPC requests are counted under the method's name, not under an HTTP endpoint: a served one, a
// refused one and one that is no GenerateRequest (400), and one for an unknown model (404); the
// exposition stays valid for Prometheus.
TEST_F(RouterFrontTest, GrpcRequestsAreCountedUnderTheGrpcMethod) {
  StartRouter();
  pv1::GenerateRequest request;
  request.set_model("tiny");
  request.mutable_token_ids()->add_ids(5);
  request.set_max_tokens(2);
  std::vector<pv1::GenerateResponse> out;
  ASSERT_TRUE(testing::GenerateAll(*stub_, request, &out).ok());
  request.set_temperature(5);
  EXPECT_EQ(testing::GenerateAll(*stub_, request, &out).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  request.clear_temperature();
  request.set_model("other");
  EXPECT_EQ(testing::GenerateAll(*stub_, request, &out).error_code(), grpc::StatusCode::NOT_FOUND);
  // Bytes that are no GenerateRequest: counted as a 400 too (they were not before 2026-12-05).
  EXPECT_EQ(RawGenerate(front_->port(), std::string("\xff\xff\xff\xff"), &out).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  front_->Stop();

  const std::string metrics = service_->MetricsText();
  const std::string grpc = R"(endpoint="pdserve.v1.Generation/Generate")";
  for (const std::string& series :
       {"pdserve_router_requests_total{" + grpc + R"(,finish_reason="length",status="200"} 1)",
        "pdserve_router_requests_total{" + grpc + R"(,finish_reason="error",status="400"} 2)",
        "pdserve_router_requests_total{" + grpc + R"(,finish_reason="error",status="404"} 1)",
        "pdserve_router_time_to_first_token_seconds_count{" + grpc + "} 1",
        "pdserve_router_e2e_request_latency_seconds_count{" + grpc + "} 1"}) {
    EXPECT_NE(metrics.find(series), std::string::npos) << series << "\n" << metrics;
  }
  // Nothing under the HTTP endpoints.
  for (const char* series :
       {R"(pdserve_router_requests_total{endpoint="completions",finish_reason="length",)"
        R"(status="200"} 0)",
        R"(pdserve_router_requests_total{endpoint="completions",finish_reason="error",)"
        R"(status="400"} 0)",
        R"(pdserve_router_time_to_first_token_seconds_count{endpoint="completions"} 0)"}) {
    EXPECT_NE(metrics.find(series), std::string::npos) << series << "\n" << metrics;
  }
  EXPECT_EQ(metrics.find(R"(endpoint="completions",finish_reason="error",status="404")"),
            std::string::npos);
  if (!testing::HavePromtool()) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  testing::ExpectPromtoolAccepts(metrics, "router_grpc_metrics.prom");
}

}  // namespace
}  // namespace pdserve::router
