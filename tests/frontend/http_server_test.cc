#include "frontend/http_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <ctime>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/frontend/cancellable_generation.h"

namespace pdserve::frontend {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using json = nlohmann::json;

// A service that "generates" tokens t0 t1 ... (max_tokens of them) per choice on its own thread,
// `delay` apart, and can be told to fail after some tokens. Records cancellations.
class FakeService : public GenerationService {
 public:
  std::chrono::milliseconds delay{0};
  int fail_after = -1;
  std::atomic<int> cancelled{0};
  std::atomic<int> finished{0};
  std::atomic<int> starts{0};  // Start calls
  // The prompt "slow": Start waits for slow_release (at most 3 s) before it returns, as a
  // tokenizer does on a prompt of megabytes.
  absl::Notification slow_entered;
  absl::Notification slow_release;

  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  int64_t max_model_length = 0;  // 0: not stated, as GenerationService's default
  int64_t MaxModelLength() const override { return max_model_length; }
  bool Ready() const override { return true; }
  std::string metrics = "pdserve_up 1\n";
  std::string MetricsText() const override { return metrics; }

  void RecordRejected(Endpoint endpoint, Front, int http_status) override {
    absl::MutexLock lock(&rejected_mu);
    rejected.emplace_back(endpoint, http_status);
  }
  absl::Mutex rejected_mu;
  std::vector<std::pair<Endpoint, int>> rejected ABSL_GUARDED_BY(rejected_mu);
  void RecordRefused(std::optional<Endpoint> endpoint, int http_status) override {
    absl::MutexLock lock(&rejected_mu);
    refused.emplace_back(endpoint, http_status);
  }
  std::vector<std::pair<std::optional<Endpoint>, int>> refused ABSL_GUARDED_BY(rejected_mu);

  StartResult Start(const ApiRequest& req, std::shared_ptr<GenerationSink> sink) override {
    starts++;
    if (req.prompt_text && *req.prompt_text == "overflow") {
      return InvalidRequest("prompt is too long", "prompt", "context_length_exceeded");
    }
    if (req.prompt_text && *req.prompt_text == "busy") {
      return ApiError{429, "full", "rate_limit_exceeded"};
    }
    if (req.prompt_text && *req.prompt_text == "slow") {
      slow_entered.Notify();
      slow_release.WaitForNotificationWithTimeout(absl::Seconds(3));
    }
    auto gen = std::make_unique<FakeGeneration>(this);
    auto stop = gen->stop;
    const int tokens = static_cast<int>(req.max_tokens.value_or(4));
    const int n = req.n;
    const bool logprobs = req.logprobs;
    threads_.emplace_back([this, sink, stop, tokens, n, logprobs] {
      for (int t = 0; t < tokens; ++t) {
        for (int c = 0; c < n; ++c) {
          if (stop->load()) return;
          if (t == fail_after) {
            sink->OnError({500, "worker lost", "server_error"});
            return;
          }
          ChoiceDelta d;
          d.index = c;
          d.text = absl::StrCat(t == 0 ? "" : " ", "t", t);
          if (logprobs) d.logprobs.push_back({d.text, -1.0f, {}});
          if (t == tokens - 1) d.finish_reason = "length";
          sink->OnDelta(std::move(d));
        }
        std::this_thread::sleep_for(delay);
      }
      finished++;
      sink->OnComplete({3, tokens * n});
    });
    return std::unique_ptr<Generation>(std::move(gen));
  }

  ~FakeService() override {
    for (auto& t : threads_) t.join();
  }

 private:
  using FakeGeneration = testing::CancellableGeneration<FakeService>;
  std::vector<std::thread> threads_;
};

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HttpServerOptions opts;
    opts.port = 0;
    opts.max_body_bytes = 4096;
    auto s = HttpServer::Start(opts, &service_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  void TearDown() override { server_->Stop(); }

  http::response<http::string_body> Request(http::verb verb, const std::string& target,
                                            const std::string& body = "") {
    net::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
    http::request<http::string_body> req{verb, target, 11};
    req.set(http::field::host, "localhost");
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    http::write(sock, req);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(sock, buf, res);
    return res;
  }

  FakeService service_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpServerTest, HealthReadyModelsMetrics) {
  EXPECT_EQ(Request(http::verb::get, "/health").result_int(), 200);
  EXPECT_EQ(Request(http::verb::get, "/ready").result_int(), 200);
  auto models = json::parse(Request(http::verb::get, "/v1/models").body());
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  // "created": when the server started (Unix seconds), not 0.
  const int64_t created = models["data"][0]["created"].get<int64_t>();
  EXPECT_LE(created, static_cast<int64_t>(std::time(nullptr)));
  EXPECT_GT(created, static_cast<int64_t>(std::time(nullptr)) - 600);
  EXPECT_EQ(Request(http::verb::get, "/metrics").body(), "pdserve_up 1\n");
  EXPECT_EQ(Request(http::verb::get, "/nope").result_int(), 404);
  EXPECT_EQ(Request(http::verb::get, "/v1/completions").result_int(), 405);
}

// OpenAI's "retrieve model" (the openai client's models.retrieve): the listed model object, and
// model_not_found for a name the server does not serve (it was "no route for ..." before).
TEST_F(HttpServerTest, RetrieveModelByName) {
  auto found = Request(http::verb::get, "/v1/models/tiny");
  ASSERT_EQ(found.result_int(), 200) << found.body();
  auto model = json::parse(found.body());
  EXPECT_EQ(model["id"], "tiny");
  EXPECT_EQ(model["object"], "model");
  EXPECT_EQ(model["owned_by"], "pdserve");
  EXPECT_FALSE(model.contains("max_model_len"));  // not stated by the service
  // The model's context, where the service states it: the same field as the list's entry.
  service_.max_model_length = 512;
  model = json::parse(Request(http::verb::get, "/v1/models/tiny").body());
  EXPECT_EQ(model["max_model_len"], 512);
  EXPECT_EQ(json::parse(Request(http::verb::get, "/v1/models").body())["data"][0]["max_model_len"],
            512);
  auto missing = Request(http::verb::get, "/v1/models/nope");
  EXPECT_EQ(missing.result_int(), 404);
  EXPECT_EQ(json::parse(missing.body())["error"]["code"], "model_not_found");
  EXPECT_EQ(Request(http::verb::post, "/v1/models/tiny").result_int(), 405);
}

// The name is a path segment: percent-encoded octets stand for themselves (RFC 3986 2.1), as a
// client that encodes path parameters sends a name with '/' or other reserved characters. It was
// compared encoded, so "ti%6Ey" (and "org%2Fmodel" for a served "org/model") was not found.
TEST_F(HttpServerTest, RetrieveModelDecodesPercentEncodedNames) {
  auto encoded = Request(http::verb::get, "/v1/models/%74i%6ey");
  ASSERT_EQ(encoded.result_int(), 200) << encoded.body();
  EXPECT_EQ(json::parse(encoded.body())["id"], "tiny");
  // Not an escape: kept as sent, and still just not found.
  auto malformed = Request(http::verb::get, "/v1/models/tiny%zz");
  EXPECT_EQ(malformed.result_int(), 404);
  EXPECT_NE(json::parse(malformed.body())["error"]["message"].get<std::string>().find("tiny%zz"),
            std::string::npos);
  EXPECT_EQ(Request(http::verb::get, "/v1/models/tiny%2F").result_int(), 404);
}

TEST_F(HttpServerTest, MethodNotAllowedNamesTheMethodsAndHeadHasNoBody) {
  auto wrong = Request(http::verb::get, "/v1/chat/completions");
  EXPECT_EQ(wrong.result_int(), 405);
  EXPECT_EQ(wrong[http::field::allow], "POST");
  EXPECT_EQ(json::parse(wrong.body())["error"]["message"], "use POST");
  auto post = Request(http::verb::post, "/health");
  EXPECT_EQ(post.result_int(), 405);
  EXPECT_EQ(post[http::field::allow], "GET, HEAD");
  // HEAD: the GET response's status and Content-Length, no body (the next request on the same
  // connection would fail to parse if one were sent).
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  beast::flat_buffer buf;
  for (const char* target : {"/health", "/v1/models", "/metrics"}) {
    http::request<http::empty_body> head{http::verb::head, target, 11};
    head.set(http::field::host, "localhost");
    http::write(sock, head);
    http::response_parser<http::string_body> parser;
    parser.skip(true);
    http::read(sock, buf, parser);
    EXPECT_EQ(parser.get().result_int(), 200) << target;
    EXPECT_NE(parser.get()[http::field::content_length], "0") << target;
    EXPECT_TRUE(parser.get().body().empty()) << target;
  }
  http::request<http::empty_body> get{http::verb::get, "/health", 11};
  get.set(http::field::host, "localhost");
  http::write(sock, get);
  http::response<http::string_body> res;
  http::read(sock, buf, res);
  EXPECT_EQ(res.body(), R"({"status":"ok"})");
}

TEST_F(HttpServerTest, RefusedRequestsAreReportedAnd429SaysRetryAfter) {
  EXPECT_EQ(Request(http::verb::post, "/v1/completions", "{not json").result_int(), 400);
  EXPECT_EQ(Request(http::verb::post, "/v1/chat/completions",
                    R"({"model":"nope","messages":[{"role":"user","content":"hi"}]})")
                .result_int(),
            404);
  {
    absl::MutexLock lock(&service_.rejected_mu);
    ASSERT_EQ(service_.rejected.size(), 2u);
    EXPECT_EQ(service_.rejected[0], std::make_pair(Endpoint::kCompletions, 400));
    EXPECT_EQ(service_.rejected[1], std::make_pair(Endpoint::kChatCompletions, 404));
  }
  auto busy = Request(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"busy"})");
  EXPECT_EQ(busy.result_int(), 429);
  EXPECT_EQ(busy[http::field::retry_after], "1");
  auto ok = Request(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"hi"})");
  EXPECT_EQ(ok.result_int(), 200);
  EXPECT_EQ(ok.count(http::field::retry_after), 0u);
}

TEST_F(HttpServerTest, NonStreamedCompletion) {
  auto res = Request(http::verb::post, "/v1/completions",
                     R"({"model":"tiny","prompt":"hi","max_tokens":3,"n":2})");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  auto j = json::parse(res.body());
  EXPECT_EQ(j["object"], "text_completion");
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["text"], "t0 t1 t2");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 6);
  EXPECT_EQ(j["usage"]["total_tokens"], 9);
}

TEST_F(HttpServerTest, StreamedChatEndsWithDone) {
  auto res = Request(http::verb::post, "/v1/chat/completions",
                     R"({"model":"tiny","messages":[{"role":"user","content":"hi"}],
                         "max_tokens":3,"stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(res.result_int(), 200);
  EXPECT_EQ(res[http::field::content_type], "text/event-stream");
  std::vector<std::string> events = absl::StrSplit(res.body(), "\n\n", absl::SkipEmpty());
  ASSERT_EQ(events.size(), 5u) << res.body();  // 3 deltas, usage, [DONE]
  std::string text;
  for (int i = 0; i < 3; ++i) {
    auto j = json::parse(events[static_cast<size_t>(i)].substr(6));
    EXPECT_EQ(j["object"], "chat.completion.chunk");
    if (i == 0) {
      EXPECT_EQ(j["choices"][0]["delta"]["role"], "assistant");
    }
    text += j["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, "t0 t1 t2");
  EXPECT_EQ(json::parse(events[3].substr(6))["usage"]["completion_tokens"], 3);
  EXPECT_EQ(events[4], "data: [DONE]");
}

// /v1/completions' logprobs.text_offset counts from the start of the choice's text in every
// chunk of a stream too, as in the non-streamed response (it restarted at 0 in each chunk).
TEST_F(HttpServerTest, StreamedTextOffsetsCountFromTheStartOfTheText) {
  const std::string request = R"({"model":"tiny","prompt":"hi","max_tokens":3,"logprobs":0)";
  auto whole = Request(http::verb::post, "/v1/completions", request + "}");
  ASSERT_EQ(whole.result_int(), 200) << whole.body();
  const json expected = json::parse(whole.body())["choices"][0]["logprobs"]["text_offset"];
  EXPECT_EQ(expected, json({0, 2, 5}));
  auto streamed = Request(http::verb::post, "/v1/completions", request + R"(,"stream":true})");
  ASSERT_EQ(streamed.result_int(), 200) << streamed.body();
  std::vector<std::string> events = absl::StrSplit(streamed.body(), "\n\n", absl::SkipEmpty());
  ASSERT_EQ(events.size(), 4u) << streamed.body();  // 3 deltas, [DONE]
  json offsets = json::array();
  for (size_t i = 0; i < 3; ++i) {
    const json chunk = json::parse(events[i].substr(6));
    for (const json& o : chunk["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(o);
  }
  EXPECT_EQ(offsets, expected);
}

TEST_F(HttpServerTest, ErrorsUseOpenAiShapeAndStatus) {
  auto bad = Request(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":7})");
  EXPECT_EQ(bad.result_int(), 400);
  EXPECT_EQ(json::parse(bad.body())["error"]["param"], "prompt");
  auto model = Request(http::verb::post, "/v1/completions", R"({"model":"big","prompt":"x"})");
  EXPECT_EQ(model.result_int(), 404);
  EXPECT_EQ(json::parse(model.body())["error"]["code"], "model_not_found");
  auto ctx =
      Request(http::verb::post, "/v1/completions", R"({"model":"tiny","prompt":"overflow"})");
  EXPECT_EQ(ctx.result_int(), 400);
  EXPECT_EQ(json::parse(ctx.body())["error"]["code"], "context_length_exceeded");
  auto big = Request(http::verb::post, "/v1/completions",
                     absl::StrCat(R"({"model":"tiny","prompt":")", std::string(5000, 'a'), "\"}"));
  EXPECT_EQ(big.result_int(), 413);
}

TEST_F(HttpServerTest, FailureMidStreamSendsErrorEventNotDone) {
  service_.fail_after = 2;
  auto res = Request(http::verb::post, "/v1/completions",
                     R"({"model":"tiny","prompt":"hi","max_tokens":5,"stream":true})");
  std::vector<std::string> events = absl::StrSplit(res.body(), "\n\n", absl::SkipEmpty());
  ASSERT_EQ(events.size(), 3u) << res.body();
  EXPECT_EQ(json::parse(events[2].substr(6))["error"]["message"], "worker lost");
  EXPECT_EQ(res.body().find("[DONE]"), std::string::npos);
}

TEST_F(HttpServerTest, DrainEndsARunningStreamWithAWholeErrorEvent) {
  service_.delay = std::chrono::milliseconds(20);  // 1000 tokens: far longer than the grace
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, "localhost");
  req.body() = R"({"model":"tiny","prompt":"hi","max_tokens":1000,"stream":true})";
  req.prepare_payload();
  http::write(sock, req);
  beast::flat_buffer buf;
  http::response_parser<http::string_body> parser;
  http::read_header(sock, buf, parser);  // the stream is running
  std::thread drain([&] { server_->Drain(std::chrono::milliseconds(50)); });
  beast::error_code ec;
  http::read(sock, buf, parser, ec);  // to the last chunk
  drain.join();
  ASSERT_FALSE(ec) << ec.message();
  const std::string body = parser.get().body();
  std::vector<std::string> events = absl::StrSplit(body, "\n\n", absl::SkipEmpty());
  ASSERT_GE(events.size(), 2u) << body;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    EXPECT_NO_THROW(json::parse(events[i].substr(6))) << events[i];
  }
  const json last = json::parse(events.back().substr(6));
  EXPECT_EQ(last["error"]["code"], "shutting_down");
  EXPECT_EQ(body.find("[DONE]"), std::string::npos);
  EXPECT_EQ(service_.cancelled.load(), 1);
}

TEST_F(HttpServerTest, ClientDisconnectMidStreamCancels) {
  service_.delay = std::chrono::milliseconds(50);
  {
    net::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
    const std::string body = R"({"model":"tiny","prompt":"hi","max_tokens":1000,"stream":true})";
    const std::string req = absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                         "Content-Length: ", body.size(), "\r\n\r\n", body);
    net::write(sock, net::buffer(req));
    char buf[512];
    sock.read_some(net::buffer(buf));  // headers and the first events are flowing
  }                                    // socket closed here
  for (int i = 0; i < 200 && service_.cancelled.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(service_.cancelled.load(), 1);
  EXPECT_EQ(service_.finished.load(), 0);
}

// Sends a 5-token completion request (streamed or not), half-closes (shutdown(SHUT_WR), as
// `nc -N` does) and reads until the server closes; returns what arrived.
std::string HalfClosedExchange(uint16_t port, bool stream) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), port});
  const std::string body = absl::StrCat(R"({"model":"tiny","prompt":"hi","max_tokens":5,"stream":)",
                                        stream ? "true" : "false", "}");
  net::write(sock, net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                            "Content-Length: ", body.size(), "\r\n\r\n", body)));
  sock.shutdown(tcp::socket::shutdown_send);
  std::string out;
  beast::error_code ec;
  char buf[4096];
  while (!ec) out.append(buf, sock.read_some(net::buffer(buf), ec));
  return out;
}

// With allow_half_close a client that half-closes after its request still gets the whole
// response, streamed or not, and nothing is stopped; by default it is taken as gone.
TEST(HttpServerHalfCloseTest, HalfClosedClientGetsTheWholeResponseWhenAllowed) {
  FakeService service;
  service.delay = std::chrono::milliseconds(30);  // the end of stream arrives mid-generation
  HttpServerOptions opts;
  opts.port = 0;
  opts.allow_half_close = true;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  for (const bool stream : {false, true}) {
    const std::string out = HalfClosedExchange((*server)->port(), stream);
    EXPECT_EQ(out.rfind("HTTP/1.1 200", 0), 0u) << out;
    EXPECT_NE(out.find(stream ? "data: [DONE]" : R"("finish_reason":"length")"), std::string::npos)
        << out;
  }
  EXPECT_EQ(service.finished.load(), 2);  // both ran to their end, none was stopped
  (*server)->Stop();
}

TEST(HttpServerHalfCloseTest, HalfClosedClientIsTakenAsGoneByDefault) {
  FakeService service;
  service.delay = std::chrono::milliseconds(30);
  HttpServerOptions opts;
  opts.port = 0;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(HalfClosedExchange((*server)->port(), /*stream=*/false), "");
  (*server)->Stop();
  EXPECT_EQ(service.finished.load(), 0);
}

TEST_F(HttpServerTest, KeepAliveServesSeveralRequests) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  beast::flat_buffer buf;
  for (int i = 0; i < 3; ++i) {
    http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
    req.set(http::field::host, "x");
    req.body() = R"({"model":"tiny","prompt":"hi","max_tokens":2,"stream":true})";
    req.prepare_payload();
    http::write(sock, req);
    http::response<http::string_body> res;
    http::read(sock, buf, res);
    EXPECT_NE(res.body().find("data: [DONE]"), std::string::npos);
  }
}

std::string RawExchange(uint16_t port, const std::string& request) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), port});
  net::write(sock, net::buffer(request));
  std::string out;
  beast::error_code ec;
  char buf[4096];
  for (;;) {
    const size_t n = sock.read_some(net::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

TEST_F(HttpServerTest, MalformedRequestGets400Json) {
  const std::string out = RawExchange(server_->port(), "GARBAGE\r\n\r\n");
  EXPECT_EQ(out.rfind("HTTP/1.1 400", 0), 0u) << out;
  EXPECT_NE(out.find("malformed HTTP request"), std::string::npos) << out;
}

// A body the server cannot read as sent gets the status that says why, in the OpenAI JSON, and
// is counted as refused: a transfer coding other than chunked 501 (the connection closes: the
// body's end is unknown), a content coding other than identity 415; chunked and identity
// bodies are served.
TEST_F(HttpServerTest, UnsupportedCodingsGet501And415) {
  const std::string body = R"({"model":"tiny","prompt":"hi","max_tokens":2})";
  auto post = [&](const std::string& headers, const std::string& payload) {
    return RawExchange(server_->port(), absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                                     headers, "\r\n", payload));
  };
  auto chunk = [](const std::string& data) {
    return absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n0\r\n\r\n");
  };
  const std::string gzip_chunked =
      post("Transfer-Encoding: gzip, chunked\r\nConnection: keep-alive\r\n", chunk(body));
  EXPECT_EQ(gzip_chunked.rfind("HTTP/1.1 501", 0), 0u) << gzip_chunked;
  EXPECT_NE(gzip_chunked.find("\"code\":\"unsupported_transfer_encoding\""), std::string::npos)
      << gzip_chunked;
  EXPECT_NE(gzip_chunked.find("Transfer-Encoding \\\"gzip, chunked\\\" is not supported"),
            std::string::npos)
      << gzip_chunked;
  EXPECT_NE(gzip_chunked.find("Connection: close"), std::string::npos) << gzip_chunked;
  const std::string identity = post("Transfer-Encoding: identity\r\n", "");
  EXPECT_EQ(identity.rfind("HTTP/1.1 501", 0), 0u) << identity;
  const std::string gzip =
      post(absl::StrCat("Content-Encoding: gzip\r\nContent-Length: ", body.size(),
                        "\r\nConnection: close\r\n"),
           body);
  EXPECT_EQ(gzip.rfind("HTTP/1.1 415", 0), 0u) << gzip;
  EXPECT_NE(gzip.find("\"code\":\"unsupported_content_encoding\""), std::string::npos) << gzip;
  // What the API takes: chunked, and an identity content coding.
  const std::string chunked =
      post("Transfer-Encoding: chunked\r\nConnection: close\r\n", chunk(body));
  EXPECT_EQ(chunked.rfind("HTTP/1.1 200", 0), 0u) << chunked;
  const std::string plain =
      post(absl::StrCat("Content-Encoding: identity\r\nContent-Length: ", body.size(),
                        "\r\nConnection: close\r\n"),
           body);
  EXPECT_EQ(plain.rfind("HTTP/1.1 200", 0), 0u) << plain;
  absl::MutexLock lock(&service_.rejected_mu);
  EXPECT_EQ(service_.rejected,
            (std::vector<std::pair<Endpoint, int>>{{Endpoint::kCompletions, 501},
                                                   {Endpoint::kCompletions, 501},
                                                   {Endpoint::kCompletions, 415}}));
}

TEST_F(HttpServerTest, OversizedHeadersGet431) {
  const std::string out =
      RawExchange(server_->port(), absl::StrCat("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ",
                                                std::string(20000, 'a'), "\r\n\r\n"));
  EXPECT_EQ(out.rfind("HTTP/1.1 431", 0), 0u) << out.substr(0, 200);
}

// Most clients (Python's http.client and requests, the openai package) send the whole body before
// they read: an oversized one must still get its 413, not a connection reset under their write.
TEST_F(HttpServerTest, OversizedBodySentWholeStillGets413) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  const std::string body(size_t{4} << 20, ' ');  // far beyond max_body_bytes (4096)
  beast::error_code ec;
  net::write(sock,
             net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                      "Content-Length: ", body.size(), "\r\n\r\n", body)),
             ec);
  EXPECT_FALSE(ec) << "writing the body: " << ec.message();
  beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(sock, buf, res, ec);
  ASSERT_FALSE(ec) << "reading the response: " << ec.message();
  EXPECT_EQ(res.result_int(), 413);
  EXPECT_NE(res.body().find("exceeds 4096 bytes"), std::string::npos) << res.body();
  EXPECT_FALSE(res.keep_alive());
}

// Refusals before the request is read whole are counted (RecordRefused): under the endpoint the
// request line named, without one when it did not arrive or parse, and not for another path.
TEST_F(HttpServerTest, RefusalsOfTheHttpLayerAreCounted) {
  EXPECT_EQ(RawExchange(server_->port(), "GARBAGE\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  const std::string bad_chunk =
      RawExchange(server_->port(),
                  "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: x\r\n"
                  "Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n");
  EXPECT_EQ(bad_chunk.rfind("HTTP/1.1 400", 0), 0u) << bad_chunk;
  const std::string big_headers = RawExchange(
      server_->port(), absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ",
                                    std::string(20000, 'a'), "\r\n\r\n"));
  EXPECT_EQ(big_headers.rfind("HTTP/1.1 431", 0), 0u) << big_headers.substr(0, 100);
  for (const char* path : {"http://localhost/v1/completions", "/elsewhere"}) {
    const std::string big_body =
        RawExchange(server_->port(), absl::StrCat("POST ", path,
                                                  " HTTP/1.1\r\nHost: x\r\n"
                                                  "Content-Length: 100000\r\n\r\n"));
    EXPECT_EQ(big_body.rfind("HTTP/1.1 413", 0), 0u) << big_body;
  }
  absl::MutexLock lock(&service_.rejected_mu);
  EXPECT_EQ(service_.refused,
            (std::vector<std::pair<std::optional<Endpoint>, int>>{{std::nullopt, 400},
                                                                  {Endpoint::kChatCompletions, 400},
                                                                  {Endpoint::kCompletions, 431},
                                                                  {Endpoint::kCompletions, 413}}));
}

TEST_F(HttpServerTest, AbsoluteFormTargetIsAccepted) {
  EXPECT_EQ(Request(http::verb::get, "http://localhost/health").result_int(), 200);
}

TEST_F(HttpServerTest, ClientThatStopsReadingIsCancelled) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  const std::string body = R"({"model":"tiny","prompt":"hi","max_tokens":2000000,"stream":true})";
  net::write(sock, net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                            "Content-Length: ", body.size(), "\r\n\r\n", body)));
  // Never read: the server's queue for this stream must hit its cap and cancel the request.
  for (int i = 0; i < 1000 && service_.cancelled.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(service_.cancelled.load(), 1);
  // And the server closed the connection: draining it ends in EOF rather than blocking.
  beast::error_code ec;
  char buf[65536];
  size_t drained = 0;
  while (!ec) drained += sock.read_some(net::buffer(buf), ec);
  EXPECT_EQ(ec, net::error::eof) << ec.message();
  EXPECT_GT(drained, 0u);
}

// HTTP/1.0 has no chunked encoding: the stream's events come unframed and the server closes the
// connection after the last one.
TEST_F(HttpServerTest, Http10StreamIsUnframedAndEndsWithClose) {
  const std::string body = R"({"model":"tiny","prompt":"hi","max_tokens":3,"stream":true})";
  const std::string out =
      RawExchange(server_->port(), absl::StrCat("POST /v1/completions HTTP/1.0\r\nContent-Length: ",
                                                body.size(), "\r\n\r\n", body));
  EXPECT_EQ(out.rfind("HTTP/1.0 200", 0), 0u) << out;
  const size_t head_end = out.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos) << out;
  const std::string head = out.substr(0, head_end);
  EXPECT_EQ(head.find("chunked"), std::string::npos) << head;
  // The body starts with the first event, not a chunk-size line, and ends with [DONE].
  const std::string events = out.substr(head_end + 4);
  EXPECT_EQ(events.rfind("data: {", 0), 0u) << events;
  EXPECT_NE(events.find("data: [DONE]\n\n"), std::string::npos) << events;
  EXPECT_EQ(events.substr(events.size() - 14), "data: [DONE]\n\n") << events;
}

// Read deadlines: a body or header cut off part way gets a 408 JSON error (the connection then
// closes); a connection that sends nothing is closed without a response; a whole request is
// served as usual.
TEST(HttpServerTimeoutTest, PartialRequestsGet408AndIdleConnectionsClose) {
  FakeService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.header_timeout = std::chrono::milliseconds(300);
  opts.body_timeout = std::chrono::milliseconds(300);
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  const auto started = std::chrono::steady_clock::now();
  // 10 of 100 announced body bytes, then nothing.
  const std::string body_cut = RawExchange(
      port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":");
  EXPECT_EQ(body_cut.rfind("HTTP/1.1 408", 0), 0u) << body_cut;
  EXPECT_NE(body_cut.find("Connection: close"), std::string::npos) << body_cut;
  const size_t json_at = body_cut.find("\r\n\r\n");
  ASSERT_NE(json_at, std::string::npos) << body_cut;
  const json error = json::parse(body_cut.substr(json_at + 4));
  EXPECT_EQ(error["error"]["code"], "request_timeout") << body_cut;
  EXPECT_EQ(error["error"]["message"], "the request body did not arrive in time") << body_cut;
  EXPECT_GE(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(250));
  // Half a header line.
  const std::string header_cut = RawExchange(port, "POST /v1/completions HTTP/1.1\r\nHo");
  EXPECT_EQ(header_cut.rfind("HTTP/1.1 408", 0), 0u) << header_cut;
  EXPECT_NE(header_cut.find("the request headers did not arrive in time"), std::string::npos)
      << header_cut;
  // Nothing at all: closed, no bytes.
  EXPECT_EQ(RawExchange(port, ""), "");
  // A whole request right away is answered as usual.
  const std::string ok =
      RawExchange(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  (*server)->Stop();
  absl::MutexLock lock(&service.rejected_mu);
  EXPECT_EQ(service.refused, (std::vector<std::pair<std::optional<Endpoint>, int>>{
                                 {Endpoint::kCompletions, 408}, {Endpoint::kCompletions, 408}}));
}

// A client that stops reading its response does not hold it (and the connection) forever: a
// write not taken within write_timeout closes the connection (a slow reader of large responses,
// or of error bodies echoing a 4 MB request, held them without bound).
TEST(HttpServerTimeoutTest, ResponsesNotReadInTimeCloseTheConnection) {
  FakeService service;
  service.metrics = std::string(size_t{64} << 20, 'm');
  HttpServerOptions opts;
  opts.port = 0;
  opts.write_timeout = std::chrono::milliseconds(300);
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.open(tcp::v4());
  sock.set_option(net::socket_base::receive_buffer_size(4096));
  sock.connect({net::ip::make_address("127.0.0.1"), (*server)->port()});
  net::write(
      sock,
      net::buffer(std::string("GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  // What the socket buffers held arrives, then the close: far less than the 64 MB body.
  size_t received = 0;
  beast::error_code ec;
  std::vector<char> buf(size_t{1} << 20);
  for (;;) {
    received += sock.read_some(net::buffer(buf), ec);
    if (ec) break;
  }
  EXPECT_LT(received, service.metrics.size());
  // The server goes on serving.
  const std::string ok = RawExchange(
      (*server)->port(), "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  (*server)->Stop();
}

// Request bodies count against one server-wide budget as their bytes arrive: beyond it a
// request gets 503, and the budget comes back when a body is read or its client goes away.
// Connections that only announce large bodies hold none of it.
TEST(HttpServerBodyBudgetTest, BodiesBeyondTheBudgetGet503) {
  FakeService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.max_body_bytes = 4096;
  opts.max_buffered_body_bytes = 6000;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  net::io_context ioc;
  // Announcing bodies holds nothing: eight clients declare 2000 bytes (or chunked) and send none
  // (counted as declared, three of them would fill the budget).
  std::vector<std::unique_ptr<tcp::socket>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<tcp::socket>(ioc));
    idle.back()->connect({net::ip::make_address("127.0.0.1"), (*server)->port()});
    net::write(*idle.back(),
               net::buffer(std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\n") +
                           (i % 2 == 0 ? "Content-Length: 2000\r\n\r\n"
                                       : "Transfer-Encoding: chunked\r\n\r\n")));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string body = R"({"model":"tiny","prompt":"hi","max_tokens":1})";
  const std::string small = RawExchange(
      (*server)->port(),
      absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                   "Connection: close\r\nContent-Length: ", body.size(), "\r\n\r\n", body));
  EXPECT_EQ(small.rfind("HTTP/1.1 200", 0), 0u) << small;
  // A client that sent 3500 of its 4000 bytes holds 3500: a 3000-byte body no longer fits.
  tcp::socket slow(ioc);
  slow.connect({net::ip::make_address("127.0.0.1"), (*server)->port()});
  net::write(slow,
             net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                      "Content-Length: 4000\r\n\r\n", std::string(3500, ' '))));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string refused = RawExchange(
      (*server)->port(), absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                      "Content-Length: 3000\r\n\r\n", std::string(3000, ' ')));
  EXPECT_EQ(refused.rfind("HTTP/1.1 503", 0), 0u) << refused.substr(0, 300);
  EXPECT_NE(refused.find("server_busy"), std::string::npos) << refused.substr(0, 300);
  // Small bodies still fit beside the held one.
  const std::string beside = RawExchange(
      (*server)->port(),
      absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                   "Connection: close\r\nContent-Length: ", body.size(), "\r\n\r\n", body));
  EXPECT_EQ(beside.rfind("HTTP/1.1 200", 0), 0u) << beside;
  // Once the slow client goes away its bytes are released.
  slow.close();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string later =
      RawExchange((*server)->port(),
                  absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                               "Content-Length: 3000\r\n\r\n", std::string(3000, ' ')));
  EXPECT_EQ(later.rfind("HTTP/1.1 400", 0), 0u) << later.substr(0, 200);  // parsed: bad JSON
  for (auto& s : idle) s->close();
  (*server)->Stop();
}

TEST(HttpServerBodyBudgetTest, OneBodyOfTheLimitAlwaysFits) {
  FakeService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.max_body_bytes = 8192;
  opts.max_buffered_body_bytes = 6000;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string out =
      RawExchange((*server)->port(),
                  absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                               "Content-Length: 8000\r\n\r\n", std::string(8000, ' ')));
  EXPECT_EQ(out.rfind("HTTP/1.1 400", 0), 0u) << out.substr(0, 300);  // read and parsed
  (*server)->Stop();
}

// A whole POST /v1/completions request (Connection: close) for `prompt`, max_tokens 2.
std::string CompletionRequest(const std::string& prompt) {
  const std::string body =
      absl::StrCat(R"({"model":"tiny","max_tokens":2,"prompt":")", prompt, R"("})");
  return absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                      "Connection: close\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
}

// The service's Start (tokenizing, admission) runs off the I/O threads: with one I/O thread, a
// request whose Start takes seconds holds up neither /health nor another connection's request.
TEST(HttpServerPrepareTest, SlowStartDoesNotHoldTheIoThread) {
  FakeService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.io_threads = 1;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  auto post = [port](const std::string& prompt) {
    return RawExchange(port, CompletionRequest(prompt));
  };
  std::string slow_out;
  std::thread slow([&] { slow_out = post("slow"); });
  ASSERT_TRUE(service.slow_entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const auto started = std::chrono::steady_clock::now();
  const std::string health =
      RawExchange(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string other = post("hi");
  const auto waited = std::chrono::steady_clock::now() - started;
  service.slow_release.Notify();
  slow.join();
  EXPECT_EQ(health.rfind("HTTP/1.1 200", 0), 0u) << health;
  EXPECT_EQ(other.rfind("HTTP/1.1 200", 0), 0u) << other;
  EXPECT_LT(waited, std::chrono::milliseconds(1500)) << "held up behind the slow Start";
  EXPECT_EQ(slow_out.rfind("HTTP/1.1 200", 0), 0u) << slow_out;
  EXPECT_NE(slow_out.find("t0 t1"), std::string::npos) << slow_out;
  (*server)->Stop();
}

// A client that leaves while its request waits for a prepare thread costs no Start (tokenizing
// megabytes for nobody), and the requests queued behind it do not wait for that work.
TEST(HttpServerPrepareTest, DepartedClientsRequestIsNotStarted) {
  FakeService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.prepare_threads = 1;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  std::string slow_out;
  std::thread slow([&] { slow_out = RawExchange(port, CompletionRequest("slow")); });
  ASSERT_TRUE(service.slow_entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  {
    // Queued behind "slow" on the one prepare thread; the client sends and leaves.
    net::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect({net::ip::make_address("127.0.0.1"), port});
    net::write(sock, net::buffer(CompletionRequest("hi")));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the server sees it leave
  service.slow_release.Notify();
  slow.join();
  const std::string other = RawExchange(port, CompletionRequest("hi"));
  EXPECT_EQ(slow_out.rfind("HTTP/1.1 200", 0), 0u) << slow_out;
  EXPECT_EQ(other.rfind("HTTP/1.1 200", 0), 0u) << other;
  EXPECT_EQ(service.starts.load(), 2) << "the departed client's request was started";
  (*server)->Stop();
}

// Bodies waiting for a prepare thread stay in max_buffered_body_bytes: past it a request gets 503
// server_busy rather than queueing without bound (each waiting 4 MB prompt held ~12 MB).
TEST(HttpServerPrepareTest, BodiesWaitingForPrepareCountInTheBudget) {
  FakeService service;
  HttpServerOptions opts;
  opts.port = 0;
  opts.prepare_threads = 1;
  opts.max_body_bytes = 4096;
  opts.max_buffered_body_bytes = 4096;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  std::string slow_out, first_out;
  std::thread slow([&] { slow_out = RawExchange(port, CompletionRequest("slow")); });
  ASSERT_TRUE(service.slow_entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::thread first(
      [&] { first_out = RawExchange(port, CompletionRequest(std::string(3000, 'a'))); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // waits for the prepare thread
  const std::string second = RawExchange(port, CompletionRequest(std::string(3000, 'b')));
  service.slow_release.Notify();
  slow.join();
  first.join();
  EXPECT_EQ(slow_out.rfind("HTTP/1.1 200", 0), 0u) << slow_out;
  EXPECT_EQ(first_out.rfind("HTTP/1.1 200", 0), 0u) << first_out;
  EXPECT_EQ(second.rfind("HTTP/1.1 503", 0), 0u) << second;
  EXPECT_NE(second.find("server_busy"), std::string::npos) << second;
  // Released once started: the next one fits.
  const std::string third = RawExchange(port, CompletionRequest(std::string(3000, 'c')));
  EXPECT_EQ(third.rfind("HTTP/1.1 200", 0), 0u) << third;
  (*server)->Stop();
}

TEST(HttpServerHostTest, HostNameIsResolved) {
  FakeService service;
  HttpServerOptions opts;
  opts.host = "localhost";
  opts.port = 0;
  auto server = HttpServer::Start(opts, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  (*server)->Stop();
  opts.host = "no-such-host.invalid";
  EXPECT_EQ(HttpServer::Start(opts, &service).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::frontend
