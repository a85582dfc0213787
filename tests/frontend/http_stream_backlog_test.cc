// Streams whose client takes them slower than they are produced (HttpServerOptions::
// stream_queue_bytes, max_stream_queue_bytes, stream_stall_timeout): a client that keeps reading
// gets its whole stream; one that stalls, or lets the memory bound fill, gets whole events, an
// error event and the end of the body, never a cut event.
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "frontend/http_server.h"
#include "nlohmann/json.hpp"
#include "tests/frontend/cancellable_generation.h"

namespace pdserve::frontend {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;

constexpr size_t kEventTextBytes = 4000;

// Streams max_tokens deltas of kEventTextBytes of text each, `pace` apart (0: all at once), then
// completes. Records cancellations and RecordStreamEnded.
class BulkService : public GenerationService {
 public:
  std::chrono::milliseconds pace{0};
  std::atomic<int> cancelled{0};

  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }
  void RecordStreamEnded(Endpoint endpoint, Front, const std::string& reason) override {
    absl::MutexLock lock(&mu);
    ended.emplace_back(endpoint, reason);
  }
  absl::Mutex mu;
  std::vector<std::pair<Endpoint, std::string>> ended ABSL_GUARDED_BY(mu);

  StartResult Start(const ApiRequest& req, std::shared_ptr<GenerationSink> sink) override {
    auto gen = std::make_unique<BulkGeneration>(this);
    auto stop = gen->stop;
    const int tokens = static_cast<int>(req.max_tokens.value_or(1));
    threads_.emplace_back([this, sink, stop, tokens] {
      for (int t = 0; t < tokens; ++t) {
        if (stop->load()) return;
        ChoiceDelta d;
        d.text = std::string(kEventTextBytes, static_cast<char>('a' + t % 26));
        if (t == tokens - 1) d.finish_reason = "length";
        sink->OnDelta(std::move(d));
        if (pace.count() > 0) std::this_thread::sleep_for(pace);
      }
      stop->store(true);  // done: the generation's release is not a cancellation
      sink->OnComplete({1, tokens});
    });
    return std::unique_ptr<Generation>(std::move(gen));
  }
  ~BulkService() override {
    for (auto& t : threads_) t.join();
  }

 private:
  using BulkGeneration = testing::CancellableGeneration<BulkService>;
  std::vector<std::thread> threads_;
};

// How a test client reads its stream: nothing for `wait`, then at most `chunk` bytes every `gap`
// (with `burst`, `chunk` bytes read at once, as they arrive); once `pause_after` bytes are read
// (0: never), nothing more for `pause`.
struct ReadPlan {
  std::chrono::milliseconds wait{0};
  size_t chunk = 65536;
  std::chrono::milliseconds gap{0};
  bool burst = false;
  size_t pause_after = 0;
  std::chrono::milliseconds pause{0};
};

// A streamed completion of `tokens` events read through a 4 KiB receive buffer as `plan` says,
// until the server ends the response. Returns the response (its body the events, de-chunked);
// the read must end cleanly (a cut chunked body fails the test).
http::response<http::string_body> SlowStream(uint16_t port, int tokens, const ReadPlan& plan) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.open(tcp::v4());
  sock.set_option(net::socket_base::receive_buffer_size(4096));
  sock.connect({net::ip::make_address("127.0.0.1"), port});
  const std::string body =
      absl::StrCat(R"({"model":"tiny","prompt":"hi","max_tokens":)", tokens, R"(,"stream":true})");
  net::write(sock, net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                            "Content-Length: ", body.size(), "\r\n\r\n", body)));
  std::this_thread::sleep_for(plan.wait);
  http::response_parser<http::string_body> parser;
  parser.body_limit(size_t{1} << 30);
  beast::flat_buffer buf;
  beast::error_code ec;
  size_t read = 0;
  bool paused = false;
  while (!parser.is_done() && !ec) {
    for (size_t taken = 0; taken < plan.chunk && !parser.is_done() && !ec;) {
      const size_t n = sock.read_some(buf.prepare(plan.chunk - taken), ec);
      buf.commit(n);
      read += n;
      taken += plan.burst ? n : plan.chunk;
      if (ec == net::error::eof) parser.put_eof(ec);  // a cut body: partial_message
      while (!ec && !parser.is_done() && buf.size() > 0) {
        const size_t used = parser.put(buf.data(), ec);
        buf.consume(used);
        if (ec == http::error::need_more) {
          ec = {};
          break;
        }
      }
    }
    std::this_thread::sleep_for(plan.gap);
    if (plan.pause_after > 0 && read >= plan.pause_after && !paused) {
      paused = true;
      std::this_thread::sleep_for(plan.pause);
    }
  }
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_TRUE(parser.is_done());
  return parser.release();
}

// The SSE events of a stream's body: each must be a whole "data: ..." event.
std::vector<std::string> Events(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    EXPECT_EQ(e.substr(0, 6), "data: ") << e.substr(0, 80);
    out.emplace_back(e.substr(6));
  }
  EXPECT_EQ(body.substr(body.size() - 2), "\n\n") << "the body ends inside an event";
  return out;
}

// A client that reads steadily, if slower than the stream is produced (12 MB queued at once, past
// the default 8 MiB), still gets every event and [DONE].
TEST(HttpStreamBacklogTest, SlowReaderThatKeepsReadingGetsTheWholeStream) {
  BulkService service;
  HttpServerOptions opts;
  opts.port = 0;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const int tokens = 3000;  // 3000 x ~4.2 KB events
  const auto res =
      SlowStream((*server)->port(), tokens, {.chunk = 65536, .gap = std::chrono::milliseconds(2)});
  EXPECT_EQ(res.result_int(), 200);
  const std::vector<std::string> events = Events(res.body());
  ASSERT_EQ(events.size(), static_cast<size_t>(tokens) + 1);
  for (int t = 0; t < tokens; ++t) {
    const json e = json::parse(events[static_cast<size_t>(t)]);
    ASSERT_EQ(e["choices"][0]["text"].get<std::string>().size(), kEventTextBytes);
    ASSERT_EQ(e["choices"][0]["text"].get<std::string>()[0], static_cast<char>('a' + t % 26));
  }
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(service.cancelled.load(), 0);
  (*server)->Stop();
}

// A server for `service` that checks streams past 256 KiB queued, with `stall_timeout`.
std::unique_ptr<HttpServer> StartSmallQueueServer(BulkService* service,
                                                  std::chrono::milliseconds stall_timeout) {
  HttpServerOptions opts;
  opts.port = 0;
  opts.stream_queue_bytes = 256 << 10;
  opts.stream_stall_timeout = stall_timeout;
  auto server = HttpServer::Start(opts, service);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

// A client that takes its stream in bursts, each a pause longer than stream_stall_timeout apart
// (what the server sees of a reader of a large receive buffer: its kernel acknowledges nothing
// until the reader has freed a part of it, docs/operations.md "Slow stream readers"), is not
// stalled: its pauses are within twice the timeout, and it gets the whole stream.
TEST(HttpStreamBacklogTest, ReaderWithPausesLongerThanTheStallTimeoutGetsTheWholeStream) {
  BulkService service;
  service.pace = std::chrono::milliseconds(1);
  auto server = StartSmallQueueServer(&service, std::chrono::milliseconds(500));
  ASSERT_NE(server, nullptr);
  const int tokens = 1200;  // ~5 MB: 10 bursts of 512 KiB, 800 ms apart
  const auto res =
      SlowStream(server->port(), tokens,
                 {.chunk = 512 << 10, .gap = std::chrono::milliseconds(800), .burst = true});
  EXPECT_EQ(res.result_int(), 200);
  const std::vector<std::string> events = Events(res.body());
  ASSERT_EQ(events.size(), static_cast<size_t>(tokens) + 1) << events.back();
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(service.cancelled.load(), 0);
  server->Stop();
  absl::MutexLock lock(&service.mu);
  EXPECT_TRUE(service.ended.empty());
}

// A client whose pauses were short (here 300 ms, a tenth of the stall timeout or more) and that
// then stops is ended within one stall timeout, not two.
TEST(HttpStreamBacklogTest, ReaderThatStopsAfterShortPausesIsEndedWithinOneStallTimeout) {
  BulkService service;
  service.pace = std::chrono::milliseconds(1);
  auto server = StartSmallQueueServer(&service, std::chrono::milliseconds(1000));
  ASSERT_NE(server, nullptr);
  const int tokens = 8000;  // ~34 MB at ~4 MB/s: still produced when the client stops
  // 512 KiB every 300 ms (~1.7 MB/s); after 6 MiB, nothing for 1.5 s: past one stall timeout,
  // within two.
  const auto res = SlowStream(server->port(), tokens,
                              {.chunk = 512 << 10,
                               .gap = std::chrono::milliseconds(300),
                               .burst = true,
                               .pause_after = 6 << 20,
                               .pause = std::chrono::milliseconds(1500)});
  EXPECT_EQ(res.result_int(), 200);
  const std::vector<std::string> events = Events(res.body());
  ASSERT_GE(events.size(), 2u);
  EXPECT_LT(events.size(), static_cast<size_t>(tokens));
  const json error = json::parse(events.back());
  EXPECT_EQ(error["error"]["code"], "stream_stalled") << events.back();
  EXPECT_EQ(service.cancelled.load(), 1);
  server->Stop();
}

// A client that reads nothing for longer than stream_stall_timeout, with more than
// stream_queue_bytes waiting, has its request cancelled; what it then reads is whole events and
// an error event "stream_stalled" at the end of the body (no [DONE]), and the connection closes.
TEST(HttpStreamBacklogTest, StalledReaderGetsWholeEventsThenAnErrorEvent) {
  BulkService service;
  service.pace = std::chrono::milliseconds(1);
  auto server = StartSmallQueueServer(&service, std::chrono::milliseconds(300));
  ASSERT_NE(server, nullptr);
  // 8000 tokens take 8 s or more to produce; the client reads nothing for 4 s, long enough for
  // the queue to pass its bound and the stall rule to end the stream even when the machine is
  // loaded (with 4000 tokens and a 1.5 s wait, a loaded 2-core run once produced too slowly to
  // fill the socket buffers and the queue in time, and the whole stream arrived).
  const int tokens = 8000;
  const auto res = SlowStream(server->port(), tokens, {.wait = std::chrono::milliseconds(4000)});
  EXPECT_EQ(res.result_int(), 200);
  const std::vector<std::string> events = Events(res.body());
  ASSERT_GE(events.size(), 2u);
  EXPECT_LT(events.size(), static_cast<size_t>(tokens));
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json e = json::parse(events[i]);
    ASSERT_EQ(e["choices"][0]["text"].get<std::string>().size(), kEventTextBytes) << i;
  }
  const json error = json::parse(events.back());
  EXPECT_EQ(error["error"]["code"], "stream_stalled") << events.back();
  EXPECT_EQ(error["error"]["type"], "invalid_request_error") << events.back();
  EXPECT_EQ(service.cancelled.load(), 1);
  server->Stop();
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(
      service.ended,
      (std::vector<std::pair<Endpoint, std::string>>{{Endpoint::kCompletions, "stream_stalled"}}));
}

// A client that keeps reading but lets max_stream_queue_bytes pile up is ended the same way,
// with "stream_too_slow": one stream's memory stays bounded.
TEST(HttpStreamBacklogTest, ReaderFarBehindIsEndedAtTheMemoryBound) {
  BulkService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.stream_queue_bytes = 64 << 10;
  opts.max_stream_queue_bytes = 512 << 10;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  // Far more than the bound holds (~3500 events), so the producer is still running when the
  // server ends the stream: a generation that completed first has nothing left to cancel (with
  // 4000 the producer sometimes won the race: cancelled stayed 0 in 2 of 6 runs).
  const int tokens = 100000;
  const auto res =
      SlowStream((*server)->port(), tokens, {.chunk = 16384, .gap = std::chrono::milliseconds(1)});
  EXPECT_EQ(res.result_int(), 200);
  const std::vector<std::string> events = Events(res.body());
  ASSERT_GE(events.size(), 1u);
  EXPECT_LT(events.size(), static_cast<size_t>(tokens));
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    ASSERT_EQ(json::parse(events[i])["choices"][0]["text"].get<std::string>().size(),
              kEventTextBytes)
        << i;
  }
  const json error = json::parse(events.back());
  EXPECT_EQ(error["error"]["code"], "stream_too_slow") << events.back();
  // The cancel may land just after the response's last byte.
  for (int i = 0; i < 200 && service.cancelled.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(service.cancelled.load(), 1);
  (*server)->Stop();
  absl::MutexLock lock(&service.mu);
  EXPECT_EQ(
      service.ended,
      (std::vector<std::pair<Endpoint, std::string>>{{Endpoint::kCompletions, "stream_too_slow"}}));
}

}  // namespace
}  // namespace pdserve::frontend
