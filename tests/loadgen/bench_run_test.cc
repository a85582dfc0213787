// The load generator against an in-process frontend::HttpServer whose fake service injects known
// delays: measured TTFT / ITL / E2E must match them, errors must be classified, runs must end.
#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "frontend/http_server.h"
#include "loadgen/dataset.h"
#include "loadgen/runner.h"
#include "loadgen/stats.h"
#include "loadgen/stream_client.h"
#include "tests/loadgen/fake_service.h"

namespace pdserve::loadgen {
namespace {

using std::chrono::milliseconds;

class BenchRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    frontend::HttpServerOptions opts;
    opts.port = 0;
    auto server = frontend::HttpServer::Start(opts, &service_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto url = ParseEndpointUrl("http://127.0.0.1:" + std::to_string(server_->port()) + "/v1");
    ASSERT_TRUE(url.ok());
    options_.url = *url;
    options_.request_timeout_s = 20;  // a broken test fails instead of hanging
  }
  void TearDown() override { server_->Stop(); }

  void UsePrompt(Api api, const std::string& prompt, int64_t max_tokens) {
    PromptItem item;
    item.prompt = prompt;
    options_.requests = {
        {ApiPath(api),
         RequestBody(item, {.api = api, .model = "fake", .default_max_tokens = max_tokens})}};
  }

  FakeTokenService service_;
  std::unique_ptr<frontend::HttpServer> server_;
  RunOptions options_;
};

TEST_F(BenchRunTest, MeasuresInjectedTtftItlAndE2e) {
  service_.first_token_delay = milliseconds(80);
  service_.token_delay = milliseconds(25);
  UsePrompt(Api::kChat, "hi", 6);
  options_.num_requests = 8;
  options_.max_concurrency = 4;
  auto result = loadgen::Run(options_);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->samples.size(), 8u);
  for (const RequestSample& s : result->samples) {
    ASSERT_TRUE(s.ok()) << s.error_kind << " " << s.error_detail;
    EXPECT_EQ(s.output_tokens, 6);
    EXPECT_EQ(s.input_tokens, 5);
    EXPECT_EQ(s.itl_s.size(), 5u);
    EXPECT_EQ(s.text, " w0 w1 w2 w3 w4 w5");
  }
  const RunSummary r = Summarize(result->samples, result->duration_s, std::nullopt);
  // Delays only ever add up: measured >= injected. The upper bounds only catch gross errors
  // (wrong units, a missing delay): a loaded 2-core CI machine running other tests beside this
  // one adds hundreds of ms of scheduling noise.
  EXPECT_GE(r.ttft.p50_ms, 80 - 1);
  EXPECT_LE(r.ttft.p50_ms, 80 + 1500);
  EXPECT_GE(r.itl.p50_ms, 25 - 5);
  EXPECT_LE(r.itl.p50_ms, 25 + 500);
  EXPECT_GE(r.e2e.p50_ms, 80 + 5 * 25 - 1);
  EXPECT_LE(r.e2e.p50_ms, 80 + 5 * 25 + 3000);
  EXPECT_GE(r.tpot.p50_ms, 25 - 5);
  EXPECT_LE(r.tpot.p50_ms, 25 + 500);
  // Two waves of 4 concurrent requests.
  EXPECT_GE(result->duration_s, 2 * 0.205 - 0.002);
}

TEST_F(BenchRunTest, CompletionsEndpointStreamsToo) {
  UsePrompt(Api::kCompletions, "hi", 3);
  options_.num_requests = 2;
  options_.max_concurrency = 2;
  auto result = loadgen::Run(options_);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const RequestSample& s : result->samples) {
    ASSERT_TRUE(s.ok()) << s.error_kind << " " << s.error_detail;
    EXPECT_EQ(s.text, " w0 w1 w2");
  }
}

TEST_F(BenchRunTest, ClassifiesHttpAndInStreamErrors) {
  UsePrompt(Api::kCompletions, "overflow", 3);
  options_.num_requests = 3;
  options_.max_concurrency = 3;
  auto rejected = loadgen::Run(options_);
  ASSERT_TRUE(rejected.ok());
  EXPECT_EQ(Summarize(rejected->samples, 1, std::nullopt).errors.at("http_400"), 3);

  service_.fail_after = 2;
  UsePrompt(Api::kCompletions, "hi", 5);
  auto broken = loadgen::Run(options_);
  ASSERT_TRUE(broken.ok());
  const RunSummary r = Summarize(broken->samples, 1, std::nullopt);
  EXPECT_EQ(r.errors.at("stream_error"), 3);
  EXPECT_EQ(r.completed, 0);
}

TEST_F(BenchRunTest, ConnectionRefusedIsAConnectError) {
  // A port bound but not listening refuses connections, and no other process can take it.
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::socket bound(ioc);
  bound.open(boost::asio::ip::tcp::v4());
  bound.bind({boost::asio::ip::make_address("127.0.0.1"), 0});
  options_.url.port = std::to_string(bound.local_endpoint().port());
  options_.request_timeout_s = 5;
  UsePrompt(Api::kCompletions, "hi", 3);
  options_.num_requests = 2;
  options_.max_concurrency = 1;
  auto result = loadgen::Run(options_);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(Summarize(result->samples, 1, std::nullopt).errors.at("connect"), 2);
}

TEST_F(BenchRunTest, PoissonRunStopsAtItsDurationAndTimesOutStragglers) {
  service_.first_token_delay = milliseconds(0);
  service_.token_delay = milliseconds(100);
  UsePrompt(Api::kCompletions, "hi", 300);  // 30 s per request, far past the drain limit
  options_.rate = 20;
  options_.duration_s = 0.3;
  options_.drain_timeout_s = 0.2;
  auto result = loadgen::Run(options_);
  ASSERT_TRUE(result.ok());
  EXPECT_GE(result->duration_s, 0.5 - 0.01);
  // Ends near duration + drain (0.5 s), never at the requests' natural end (30 s); the bound
  // leaves room for a loaded CI machine.
  EXPECT_LE(result->duration_s, 10);
  ASSERT_FALSE(result->samples.empty());
  for (const RequestSample& s : result->samples) EXPECT_EQ(s.error_kind, "timeout");
}

TEST_F(BenchRunTest, RejectsUnboundedRuns) {
  UsePrompt(Api::kCompletions, "hi", 3);
  options_.max_concurrency = 2;
  EXPECT_EQ(loadgen::Run(options_).status().code(), absl::StatusCode::kInvalidArgument);
}

// NaN passed every "<= 0" check: `pdserve bench --rate nan --duration 1` then issued requests in
// a loop that never yielded to its timers (a hang, memory growing).
TEST_F(BenchRunTest, RejectsNonFiniteRatesAndTimes) {
  UsePrompt(Api::kCompletions, "hi", 1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (auto set : std::vector<std::function<void(RunOptions&)>>{
           [nan](RunOptions& o) { o.rate = nan; },
           [nan](RunOptions& o) { o.duration_s = nan; },
           [inf](RunOptions& o) { o.duration_s = inf; },
           [nan](RunOptions& o) { o.request_timeout_s = nan; },
           [inf](RunOptions& o) { o.request_timeout_s = inf; },
           [nan](RunOptions& o) { o.drain_timeout_s = nan; },
       }) {
    RunOptions options = options_;
    options.num_requests = 1;
    options.max_concurrency = 1;
    set(options);
    EXPECT_EQ(loadgen::Run(options).status().code(), absl::StatusCode::kInvalidArgument)
        << "rate " << options.rate << ", duration " << options.duration_s << ", timeouts "
        << options.request_timeout_s << " / " << options.drain_timeout_s;
  }
}

TEST(EndpointUrlTest, ParsesBaseUrlsAndRefusesRemoteHostsByDefault) {
  auto url = ParseEndpointUrl("http://localhost:8123/v1/");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->host, "localhost");
  EXPECT_EQ(url->port, "8123");
  EXPECT_EQ(url->path_prefix, "");
  EXPECT_EQ(ParseEndpointUrl("http://[::1]:9/x")->path_prefix, "/x");
  EXPECT_FALSE(ParseEndpointUrl("https://example.com").ok());
  EXPECT_TRUE(ParseTargetUrl("http://127.0.0.2:80", false).ok());
  EXPECT_EQ(ParseTargetUrl("http://10.1.2.3:8000", false).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(ParseTargetUrl("http://10.1.2.3:8000", true).ok());
}

// http://127.0.0.1:<port> on a port just bound and released (`*port`): connecting is refused.
EndpointUrl UrlWhereNothingListens(std::string* port) {
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::acceptor probe(
      ioc, boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0));
  *port = std::to_string(probe.local_endpoint().port());
  probe.close();
  absl::StatusOr<EndpointUrl> url = ParseEndpointUrl("http://127.0.0.1:" + *port);
  EXPECT_TRUE(url.ok()) << url.status();
  return url.ok() ? *url : EndpointUrl();
}

// A server that is not up (yet): the error says that nothing listens at that address, not just
// "Connection refused" (a new user ran `check` right after `pdserve up ... &`).
TEST(EndpointUrlTest, NothingListeningSaysSo) {
  std::string port;
  const EndpointUrl url = UrlWhereNothingListens(&port);
  const absl::StatusOr<std::string> model = FirstServedModel(url);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(model.status().message().find("nothing listens there"), std::string::npos)
      << model.status();
  EXPECT_NE(model.status().message().find("127.0.0.1:" + port), std::string::npos);
}

// `bench --model M` does not ask GET /v1/models first: its requests' own connect errors say the
// same (each one was a bare "Connection refused", with no address).
TEST(EndpointUrlTest, BenchRequestsToNothingListeningSaySo) {
  std::string port;
  const EndpointUrl url = UrlWhereNothingListens(&port);
  RunOptions options;
  options.url = url;
  PromptItem item;
  item.prompt = "hi";
  options.requests = {
      {ApiPath(Api::kCompletions), RequestBody(item, {.api = Api::kCompletions, .model = "m"})}};
  options.num_requests = 2;
  options.max_concurrency = 1;
  options.request_timeout_s = 20;
  auto result = loadgen::Run(options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->samples.size(), 2u);
  for (const RequestSample& s : result->samples) {
    EXPECT_EQ(s.error_kind, "connect");
    EXPECT_NE(s.error_detail.find("nothing listens there"), std::string::npos) << s.error_detail;
    EXPECT_NE(s.error_detail.find("127.0.0.1:" + port), std::string::npos) << s.error_detail;
  }
}

}  // namespace
}  // namespace pdserve::loadgen
