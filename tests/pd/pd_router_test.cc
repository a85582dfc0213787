// The router (router::RouterService in this process) in front of real `pdserve prefill` and
// `pdserve decode` processes over loopback UCX tcp: what the router does with the decode worker's
// answers that the fake workers of tests/router cannot show (real page accounting).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "router/service.h"
#include "tests/pd/pd_cluster.h"
#include "tests/router/fake_workers.h"

namespace pdserve::pd::testing {
namespace {

namespace v1 = pdserve::worker::v1;

class Sink : public frontend::GenerationSink {
 public:
  void OnDelta(frontend::ChoiceDelta delta) override {
    absl::MutexLock lock(&mu);
    if (static_cast<size_t>(delta.index) >= text.size()) text.resize(delta.index + 1);
    text[delta.index] += delta.text;
  }
  void OnComplete(frontend::Usage u) override {
    usage = u;
    done.Notify();
  }
  void OnError(frontend::ApiError e) override {
    error = std::move(e);
    failed = true;
    done.Notify();
  }
  absl::Mutex mu;
  std::vector<std::string> text;
  frontend::Usage usage;
  frontend::ApiError error;
  bool failed = false;
  absl::Notification done;
};

config::WorkerConfig Worker(const std::string& name, int port) {
  config::WorkerConfig w;
  w.name = name;
  w.host = "127.0.0.1";
  w.port = port;
  w.backend = "cpu";
  return w;
}

class PdRouterTest : public ::testing::Test {
 protected:
  void SetUp() override { router::testing::KeepCallbackQueueAlive(); }

  void StartCluster(ClusterOptions options) {
    auto cluster = PdCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  // The fixture owns the router, so Generations a test leaves behind (an ASSERT that returned
  // early) end before it goes.
  router::RouterService* MakeRouter(router::RouterOptions options) {
    options.model_dir = PDSERVE_BUNDLED_MODEL;
    options.prefill = {Worker("prefill-0", cluster_->prefill_port())};
    options.decode = {Worker("decode-0", cluster_->decode_port())};
    options.canary = false;
    options.background_checks = false;
    auto service = router::RouterService::Create(options);
    EXPECT_TRUE(service.ok()) << service.status();
    (*service)->pool().CheckAll();
    EXPECT_TRUE((*service)->Ready());
    routers_.push_back(std::move(*service));
    return routers_.back().get();
  }

  static frontend::ApiRequest Completion(int prompt_length, int max_tokens) {
    frontend::ApiRequest req;
    req.model = PDSERVE_BUNDLED_MODEL;
    std::vector<int32_t> prompt;
    for (int t = 0; t < prompt_length; ++t) prompt.push_back(100 + (t * 37) % 3900);
    req.prompt_tokens = prompt;
    req.max_tokens = max_tokens;
    req.seed = 7;
    return req;
  }

  std::shared_ptr<Sink> Start(router::RouterService& router, const frontend::ApiRequest& req,
                              std::unique_ptr<frontend::Generation>* generation = nullptr) {
    auto sink = std::make_shared<Sink>();
    frontend::StartResult started = router.Start(req, sink);
    if (auto* error = std::get_if<frontend::ApiError>(&started)) {
      sink->OnError(*error);
    } else if (generation != nullptr) {
      *generation = std::move(std::get<std::unique_ptr<frontend::Generation>>(started));
    } else {
      generations_.push_back(std::move(std::get<std::unique_ptr<frontend::Generation>>(started)));
    }
    return sink;
  }

  // Idle: every decode page free (the last streams' slots free just after their final event).
  void WaitForIdleDecode() {
    for (int i = 0; i < 250; ++i) {
      const v1::StatsResponse stats = DecodeStats(*cluster_);
      if (stats.pages_free() == stats.pages_total()) return;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  std::unique_ptr<PdCluster> cluster_;
  std::vector<std::unique_ptr<router::RouterService>> routers_;  // destroyed after generations_
  std::vector<std::unique_ptr<frontend::Generation>> generations_;
};

// More choices than the decode worker's batch slots (it states --max-batch in Health) is a 400
// naming n and the slots, and nothing is reserved: every page stays free. Before, each try
// reserved max_batch choices, then aborted them, and the client got 429 "retry later".
TEST_F(PdRouterTest, FanOutWiderThanTheBatchIs400AndReservesNothing) {
  ClusterOptions cluster;
  cluster.decode_max_batch = 4;
  StartCluster(cluster);
  auto router = MakeRouter({});
  EXPECT_EQ(router->pool().decode()[0]->max_batch(), 4);
  frontend::ApiRequest req = Completion(12, 4);
  req.n = 5;
  std::shared_ptr<Sink> wide = Start(*router, req);
  wide->done.WaitForNotification();
  ASSERT_TRUE(wide->failed);
  EXPECT_EQ(wide->error.http_status, 400);
  EXPECT_EQ(wide->error.param, "n");
  EXPECT_EQ(wide->error.message,
            "'n' is 5 but the choices share one prefill and decode together on one decode "
            "worker, and the widest runs at most 4 sequences at once (decode-0: max_batch 4)");
  v1::StatsResponse stats = DecodeStats(*cluster_);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.waiting_requests() + stats.running_requests(), 0);
  req.n = 4;
  std::shared_ptr<Sink> fits = Start(*router, req);
  fits->done.WaitForNotification();
  ASSERT_FALSE(fits->failed) << fits->error.message;
  EXPECT_EQ(fits->usage.completion_tokens, 16);
}

// A prompt + max_tokens needing more pages than the decode worker's whole pool (--pool-tokens)
// is FAILED_PRECONDITION on the worker before anything is reserved, and a 400 on max_tokens at
// the router; before, RESOURCE_EXHAUSTED "out of state pages" and a 429 "retry later".
TEST_F(PdRouterTest, RequestLargerThanTheWholePoolIs400OnMaxTokens) {
  ClusterOptions cluster;
  cluster.decode_max_batch = 1;
  cluster.decode_pool_tokens = 1;  // one compressed page per layer: 256 tokens at most
  StartCluster(cluster);
  RequestSpec spec;
  spec.request_id = 77;
  spec.prompt.assign(20, 9);
  spec.params.max_tokens = 480;
  grpc::ClientContext context;
  v1::ReserveResponse reserved;
  const grpc::Status refused = cluster_->decode().Reserve(&context, ReserveFor(spec), &reserved);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("more than this decode worker's whole pool holds"),
            std::string::npos)
      << refused.error_message();
  v1::StatsResponse stats = DecodeStats(*cluster_);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());

  auto router = MakeRouter({});
  std::shared_ptr<Sink> big = Start(*router, Completion(20, 480));
  big->done.WaitForNotification();
  ASSERT_TRUE(big->failed);
  EXPECT_EQ(big->error.http_status, 400);
  EXPECT_EQ(big->error.param, "max_tokens");
  EXPECT_NE(big->error.message.find("lower max_tokens"), std::string::npos) << big->error.message;
  std::shared_ptr<Sink> small = Start(*router, Completion(20, 8));
  small->done.WaitForNotification();
  EXPECT_FALSE(small->failed) << small->error.message;
  stats = DecodeStats(*cluster_);
  EXPECT_EQ(stats.pages_quarantined(), 0);
}

// More requests than the decode worker's batch slots at once: the router waits for room and
// serves them all, each equal to its alone-run (before: every one past the slots got 429). A
// client that goes away while queued leaves nothing behind.
TEST_F(PdRouterTest, RequestsBeyondTheBatchWaitForRoomAndAreServed) {
  ClusterOptions cluster;
  cluster.decode_max_batch = 2;
  StartCluster(cluster);
  auto router = MakeRouter({});
  std::vector<std::shared_ptr<Sink>> alone;
  for (int i = 0; i < 6; ++i) {
    alone.push_back(Start(*router, Completion(10 + i, 12)));
    alone.back()->done.WaitForNotification();
    ASSERT_FALSE(alone.back()->failed) << alone.back()->error.message;
  }
  // The alone-runs' slots free just after their final events: start from an idle decode worker,
  // or a third request may wait for a slot a finished one still holds (depth 5, not 4).
  WaitForIdleDecode();
  std::vector<std::shared_ptr<Sink>> together;
  for (int i = 0; i < 6; ++i) together.push_back(Start(*router, Completion(10 + i, 12)));
  auto depth = [&] {
    const std::string metrics = router->MetricsText();
    const size_t at = metrics.find("\npdserve_router_queue_depth ");
    return at == std::string::npos ? -1 : std::stoi(metrics.substr(at + 28));
  };
  for (int i = 0; i < 1000 && depth() != 4; ++i) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_EQ(depth(), 4);  // two hold the slots, four wait
  std::unique_ptr<frontend::Generation> gone;
  std::shared_ptr<Sink> gone_sink = Start(*router, Completion(30, 12), &gone);
  gone->Cancel();  // queued behind the four waiting: it leaves the queue
  for (int i = 0; i < 6; ++i) {
    together[i]->done.WaitForNotification();
    ASSERT_FALSE(together[i]->failed) << i << ": " << together[i]->error.message;
    EXPECT_EQ(together[i]->text[0], alone[i]->text[0]) << i;
    EXPECT_EQ(together[i]->usage.completion_tokens, alone[i]->usage.completion_tokens) << i;
  }
  EXPECT_FALSE(gone_sink->done.HasBeenNotified());
  const std::string metrics = router->MetricsText();
  EXPECT_NE(metrics.find("pdserve_router_queue_depth 0\n"), std::string::npos) << metrics;
  EXPECT_EQ(metrics.find("pdserve_router_queued_total 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_queue_wait_seconds_count{outcome="cancelled"} 1)"),
            std::string::npos)
      << metrics;
  WaitForIdleDecode();
  const v1::StatsResponse stats = DecodeStats(*cluster_);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.pages_quarantined(), 0);
}

}  // namespace
}  // namespace pdserve::pd::testing
