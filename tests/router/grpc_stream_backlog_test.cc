// The gRPC front's bound on what waits for a slow Generate reader (GrpcStreamOptions;
// docs/operations.md, "Slow stream readers"): a client that stops reading is ended
// "stream_stalled", one that lets too much pile up "stream_too_slow", and a client that reads gets
// its whole stream. The timeouts are small so that the runs are short; nothing asserts a time.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/grpc_front.h"
#include "tests/router/fake_workers.h"
#include "tests/router/generation_client.h"

namespace pdserve::router {
namespace {

namespace pv1 = pdserve::v1;

// Streams deltas of `delta_bytes` from a thread of its own, `pause` apart, until `total_bytes`
// are out (then finishes the choice and completes) or it is cancelled.
class FloodingService : public frontend::GenerationService {
 public:
  FloodingService(size_t delta_bytes, size_t total_bytes, absl::Duration pause)
      : delta_bytes_(delta_bytes), total_bytes_(total_bytes), pause_(pause) {}
  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  frontend::StartResult Start(const frontend::ApiRequest&,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    return std::unique_ptr<frontend::Generation>(new Flood(this, std::move(sink)));
  }
  void RecordStreamEnded(frontend::Endpoint, frontend::Front, const std::string& reason) override {
    absl::MutexLock lock(&mu);
    ended.push_back(reason);
  }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }

  // Waits until the generation was cancelled; the bound only limits a failing run.
  bool AwaitCancelled() {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(absl::Condition(&cancelled), absl::Seconds(120));
  }

  absl::Mutex mu;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  size_t produced ABSL_GUARDED_BY(mu) = 0;  // text bytes handed to the sink
  std::vector<std::string> ended ABSL_GUARDED_BY(mu);

 private:
  class Flood : public frontend::Generation {
   public:
    Flood(FloodingService* owner, std::shared_ptr<frontend::GenerationSink> sink)
        : owner_(owner), thread_([this, sink = std::move(sink)] { Run(*sink); }) {}
    ~Flood() override {
      Cancel();
      thread_.join();
    }
    void Cancel() override {
      if (stop_.exchange(true)) return;
      absl::MutexLock lock(&owner_->mu);
      owner_->cancelled = true;
    }

   private:
    void Run(frontend::GenerationSink& sink) {
      const std::string text(owner_->delta_bytes_, 'x');
      for (size_t sent = 0; sent < owner_->total_bytes_; sent += text.size()) {
        if (stop_.load()) return;
        sink.OnDelta({0, text, {}, std::nullopt});
        {
          absl::MutexLock lock(&owner_->mu);
          owner_->produced += text.size();
        }
        absl::SleepFor(owner_->pause_);
      }
      sink.OnDelta({0, "", {}, std::string("length")});
      sink.OnComplete({1, 1});
    }

    FloodingService* owner_;
    std::atomic<bool> stop_{false};
    std::thread thread_;  // last: it starts running in the constructor
  };

  const size_t delta_bytes_;
  const size_t total_bytes_;
  const absl::Duration pause_;
};

// The OpenAI error JSON of a call the front ended for its reader: RESOURCE_EXHAUSTED.
nlohmann::json SlowEndError(const grpc::Status& status) {
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  return nlohmann::json::parse(status.error_message())["error"];
}

class GrpcStreamBacklogTest : public ::testing::Test {
 protected:
  // The service (a member declared before the front, so it outlives it: the front may destroy a
  // cancelled generation, whose destructor locks the service, after the test body returned; a
  // service on the test body's stack was gone by then, a rare SEGFAULT under load).
  FloodingService& Serve(size_t delta_bytes, size_t total_bytes, absl::Duration pause,
                         GrpcStreamOptions options) {
    service_ = std::make_unique<FloodingService>(delta_bytes, total_bytes, pause);
    testing::KeepCallbackQueueAlive();
    auto front = GrpcFront::Start("127.0.0.1", 0, service_.get(), nullptr, nullptr, options);
    EXPECT_TRUE(front.ok()) << front.status();
    if (!front.ok()) return *service_;
    front_ = std::move(*front);
    stub_ = pv1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(front_->port()), grpc::InsecureChannelCredentials()));
    return *service_;
  }
  static pv1::GenerateRequest Request() {
    pv1::GenerateRequest request;
    request.set_model("tiny");
    request.set_text("And God said");
    return request;
  }
  // Starts a call, takes its first message, reads nothing more until `service` saw its generation
  // cancelled, then reads the rest. Returns the call's status; `text_bytes`: the text received.
  grpc::Status ReadOnlyAfterTheCancel(FloodingService& service, size_t* text_bytes) {
    grpc::ClientContext context;
    auto reader = stub_->Generate(&context, Request());
    pv1::GenerateResponse response;
    *text_bytes = 0;
    if (reader->Read(&response)) *text_bytes += response.choices(0).text().size();
    EXPECT_TRUE(service.AwaitCancelled());
    while (reader->Read(&response)) {
      if (response.choices_size() > 0) *text_bytes += response.choices(0).text().size();
    }
    return reader->Finish();
  }

  std::unique_ptr<FloodingService> service_;
  std::unique_ptr<GrpcFront> front_;
  std::unique_ptr<pv1::Generation::Stub> stub_;
};

TEST_F(GrpcStreamBacklogTest, AClientThatStopsReadingIsEndedStalledAndItsGenerationCancelled) {
  // 16 MB/s: 256 MB would keep the old front queueing for 16 s, and the client would then get
  // it all.
  FloodingService& service = Serve(16 << 10, size_t{256} << 20, absl::Milliseconds(1),
                                   {.stream_queue_bytes = 256 << 10,
                                    .max_stream_queue_bytes = size_t{1} << 30,
                                    .stall_timeout = absl::Milliseconds(500)});
  size_t received = 0;
  const nlohmann::json error = SlowEndError(ReadOnlyAfterTheCancel(service, &received));
  EXPECT_EQ(error["code"], "stream_stalled");
  EXPECT_EQ(error["type"], "invalid_request_error");
  EXPECT_TRUE(
      error["message"].get<std::string>().starts_with("the client read none of its stream"));
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(service.ended, std::vector<std::string>{"stream_stalled"});
  // What was queued when the call ended was dropped, not delivered.
  EXPECT_LT(received, service.produced);
  EXPECT_LT(service.produced, size_t{256} << 20);
}

TEST_F(GrpcStreamBacklogTest, AClientThatLetsTooMuchPileUpIsEndedTooSlow) {
  FloodingService& service = Serve(16 << 10, size_t{256} << 20, absl::Milliseconds(1),
                                   {.stream_queue_bytes = 256 << 10,
                                    .max_stream_queue_bytes = 2 << 20,
                                    .stall_timeout = absl::Hours(1)});
  size_t received = 0;
  EXPECT_EQ(SlowEndError(ReadOnlyAfterTheCancel(service, &received))["code"], "stream_too_slow");
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(service.ended, std::vector<std::string>{"stream_too_slow"});
  EXPECT_LT(received, service.produced);
}

TEST_F(GrpcStreamBacklogTest, AReadingClientGetsTheWholeStreamPastTheQueueBound) {
  // 16 MB produced as fast as possible: far past stream_queue_bytes while the client reads.
  constexpr size_t kTotal = size_t{16} << 20;
  FloodingService& service = Serve(16 << 10, kTotal, absl::ZeroDuration(),
                                   {.stream_queue_bytes = 256 << 10,
                                    .max_stream_queue_bytes = size_t{1} << 30,
                                    .stall_timeout = absl::Seconds(20)});
  std::vector<pv1::GenerateResponse> out;
  const grpc::Status status = testing::GenerateAll(*stub_, Request(), &out);
  ASSERT_TRUE(status.ok()) << status.error_message();
  size_t text_bytes = 0;
  for (const pv1::GenerateResponse& r : out) {
    if (r.choices_size() > 0) text_bytes += r.choices(0).text().size();
  }
  EXPECT_EQ(text_bytes, kTotal);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back().usage().completion_tokens(), 1);
  absl::MutexLock lock(&service.mu);
  EXPECT_TRUE(service.ended.empty());
}

}  // namespace
}  // namespace pdserve::router
