// The HTTP front's disconnect watch (frontend/http_server.cc, Session::WatchDisconnect): a client
// that leaves while its request runs has the request cancelled, also when it sent something after
// the request (a pipelined request, a stray CRLF, a TLS close_notify), and what it sent ahead is
// still parsed as its next request when it stays.
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "frontend/http_server.h"
#include "nlohmann/json.hpp"
#include "tests/frontend/cancellable_generation.h"

namespace pdserve::frontend {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;

const std::string kTls = PDSERVE_TLS_FIXTURES;

// Generates max_tokens tokens "t0 t1 ..." for one choice, 20 ms apart, on its own thread;
// counts starts, generations that ran to their end, and Cancel calls (the server's, or the
// generation's destruction after its end).
class SlowService : public GenerationService {
 public:
  std::atomic<int> starts{0};
  std::atomic<int> cancelled{0};
  std::atomic<int> finished{0};

  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }

  StartResult Start(const ApiRequest& req, std::shared_ptr<GenerationSink> sink) override {
    auto gen = std::make_unique<Generation>(this);
    auto stop = gen->stop;
    const int tokens = static_cast<int>(req.max_tokens.value_or(4));
    threads_.emplace_back([this, sink, stop, tokens] {
      for (int t = 0; t < tokens; ++t) {
        if (stop->load()) return;
        ChoiceDelta d;
        d.text = absl::StrCat(t == 0 ? "" : " ", "t", t);
        if (t == tokens - 1) d.finish_reason = "length";
        sink->OnDelta(std::move(d));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      finished++;
      sink->OnComplete({1, tokens});
    });
    starts++;
    return std::unique_ptr<frontend::Generation>(std::move(gen));
  }

  ~SlowService() override {
    for (auto& t : threads_) t.join();
  }

 private:
  using Generation = testing::CancellableGeneration<SlowService>;
  std::vector<std::thread> threads_;
};

std::string Completion(int max_tokens) {
  const std::string body =
      absl::StrCat(R"({"model":"tiny","prompt":"hi","max_tokens":)", max_tokens, "}");
  return absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(),
                      "\r\n\r\n", body);
}

// Polls `done` every 10 ms for at most 5 s (a bound, not a timing: it holds at once when right).
template <typename F>
bool Eventually(F done) {
  for (int i = 0; i < 500 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

class HttpDisconnectTest : public ::testing::Test {
 protected:
  void StartServer(bool tls) {
    HttpServerOptions options;
    options.port = 0;
    if (tls) {
      options.tls_cert_file = kTls + "/cluster.pem";
      options.tls_key_file = kTls + "/cluster.key";
    }
    auto server = HttpServer::Start(options, &service_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  // Sends a request for `max_tokens` tokens on `stream` and waits until the service started it.
  template <typename Stream>
  void StartRequest(Stream& stream, int max_tokens) {
    net::write(stream, net::buffer(Completion(max_tokens)));
    ASSERT_TRUE(Eventually([&] { return service_.starts.load() == 1; }));
  }
  // The request was cancelled (the client left) and did not run to its end.
  void ExpectCancelled() {
    EXPECT_TRUE(Eventually([&] { return service_.cancelled.load() == 1; }));
    EXPECT_EQ(service_.finished.load(), 0);
  }

  SlowService service_;
  std::unique_ptr<HttpServer> server_;
};

// 1000 tokens take 20 s: the request is running when the client sends two more bytes and leaves.
// The watch used to peek at the socket, saw the bytes and stopped watching.
TEST_F(HttpDisconnectTest, BytesSentAfterTheRequestDoNotHideTheClientLeaving) {
  StartServer(/*tls=*/false);
  {
    net::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
    StartRequest(sock, 1000);
    net::write(sock, net::buffer(std::string("\r\n")));
  }  // closed
  ExpectCancelled();
}

// Over TLS a client that gives up sends close_notify before it closes (curl --max-time does).
TEST_F(HttpDisconnectTest, TlsCloseNotifyCancelsTheRequest) {
  StartServer(/*tls=*/true);
  {
    net::io_context ioc;
    ssl::context context(ssl::context::tls_client);
    context.load_verify_file(kTls + "/ca.pem");
    context.set_verify_mode(ssl::verify_peer);
    beast::ssl_stream<beast::tcp_stream> stream(ioc, context);
    beast::get_lowest_layer(stream).connect({net::ip::make_address("127.0.0.1"), server_->port()});
    stream.handshake(ssl::stream_base::client);
    StartRequest(stream, 1000);
    // close_notify through the stream (the TLS layer writes to memory buffers of its own); the
    // wait for the server's alert also takes what the server sent before (TLS 1.3 session
    // tickets), so the close below is an end of stream, not a reset, which was always seen.
    stream.async_shutdown([](beast::error_code) {});
    ioc.run_for(std::chrono::milliseconds(200));
  }  // closed: end of stream after the alert
  ExpectCancelled();
}

// A request pipelined behind a running one is read ahead by the watch and served after it; here
// its first half arrives while the first request runs and the rest after the first response.
TEST_F(HttpDisconnectTest, RequestReadAheadIsServedNext) {
  StartServer(/*tls=*/false);
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  StartRequest(sock, 5);
  const std::string second = Completion(2);
  const size_t half = second.size() / 2;
  net::write(sock, net::buffer(second.substr(0, half)));
  beast::flat_buffer buf;
  http::response<http::string_body> first;
  http::read(sock, buf, first);
  ASSERT_EQ(first.result_int(), 200) << first.body();
  EXPECT_EQ(nlohmann::json::parse(first.body())["choices"][0]["text"], "t0 t1 t2 t3 t4");
  net::write(sock, net::buffer(second.substr(half)));
  http::response<http::string_body> next;
  http::read(sock, buf, next);
  ASSERT_EQ(next.result_int(), 200) << next.body();
  EXPECT_EQ(nlohmann::json::parse(next.body())["choices"][0]["text"], "t0 t1");
  EXPECT_EQ(service_.finished.load(), 2);
}

// A client may send a CRLF after a POST body (RFC 9112 2.2): the watch keeps it with the next
// request, which is served, not answered 400 bad method. The first request's 50 tokens take 1 s,
// so the watch reads the bytes while it runs.
TEST_F(HttpDisconnectTest, EmptyLinesBeforeTheNextRequestAreSkipped) {
  StartServer(/*tls=*/false);
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
  StartRequest(sock, 50);
  net::write(sock, net::buffer(absl::StrCat("\r\n\r\n\n", Completion(2))));
  beast::flat_buffer buf;
  http::response<http::string_body> first;
  http::read(sock, buf, first);
  ASSERT_EQ(first.result_int(), 200) << first.body();
  http::response<http::string_body> next;
  http::read(sock, buf, next);
  ASSERT_EQ(next.result_int(), 200) << next.body();
  EXPECT_EQ(nlohmann::json::parse(next.body())["choices"][0]["text"], "t0 t1");
  EXPECT_EQ(service_.finished.load(), 2);
}

}  // namespace
}  // namespace pdserve::frontend
