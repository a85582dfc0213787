// The HTTP front's disconnect watch (frontend/http_server.cc, Session::WatchDisconnect): a client
// that leaves while its request runs has the request cancelled, also when it sent something after
// the request (a pipelined request, a stray CRLF, a TLS close_notify), and what it sent ahead is
// still parsed as its next request when it stays. Around it: the connection's deadlines (header
// and write, each its own), empty lines before a request line, and a half-closed client's stream.
#include <gtest/gtest.h>
#include <openssl/ssl.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "frontend/http_server.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
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
  // Set before serving: each generation's first token waits for `first_token` (at most 5 s).
  bool hold_first_token = false;
  absl::Notification first_token;
  std::string metrics;  // the /metrics body

  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return metrics; }

  StartResult Start(const ApiRequest& req, std::shared_ptr<GenerationSink> sink) override {
    auto gen = std::make_unique<Generation>(this);
    auto stop = gen->stop;
    const int tokens = static_cast<int>(req.max_tokens.value_or(4));
    threads_.emplace_back([this, sink, stop, tokens] {
      if (hold_first_token) first_token.WaitForNotificationWithTimeout(absl::Seconds(5));
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

std::string Completion(int max_tokens, bool stream = false) {
  const std::string body = absl::StrCat(R"({"model":"tiny","prompt":"hi","max_tokens":)",
                                        max_tokens, stream ? R"(,"stream":true})" : "}");
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
  void StartServer(bool tls, HttpServerOptions options = {}) {
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

// One client connection, plain or TLS (trusting the test CA). Reads that wait for the server to
// close are bounded by the client's own deadline.
class Client {
 public:
  // `receive_buffer_bytes` > 0: SO_RCVBUF, set before connecting (a small window).
  Client(uint16_t port, bool tls, int receive_buffer_bytes = 0) {
    if (tls) {
      context_.load_verify_file(kTls + "/ca.pem");
      context_.set_verify_mode(ssl::verify_peer);
      tls_.emplace(ioc_, context_);
    } else {
      plain_.emplace(ioc_);
    }
    Tcp().socket().open(tcp::v4());
    if (receive_buffer_bytes > 0) {
      Tcp().socket().set_option(net::socket_base::receive_buffer_size(receive_buffer_bytes));
    }
    Tcp().connect({net::ip::make_address("127.0.0.1"), port});
    if (tls_) tls_->handshake(ssl::stream_base::client);
  }

  void Write(std::string_view bytes) {
    With([&](auto& s) { net::write(s, net::buffer(bytes.data(), bytes.size())); });
  }
  http::response<http::string_body> ReadResponse() {
    http::response<http::string_body> res;
    With([&](auto& s) { http::read(s, buffer_, res); });
    return res;
  }
  void ShutdownSend() { Tcp().socket().shutdown(tcp::socket::shutdown_send); }
  // TLS 1.3: asks the server for a KeyUpdate of its own, sent with the next bytes written. The
  // server's read of it writes one back (a write inside the server's read).
  bool RequestKeyUpdate() {
    return tls_ && SSL_key_update(tls_->native_handle(), SSL_KEY_UPDATE_REQUESTED) == 1;
  }

  struct End {
    std::string bytes;     // read before the end
    beast::error_code ec;  // how it ended; beast::error::timeout when `limit` passed first
  };
  // Reads until the connection ends or `limit` passes.
  End ReadToEnd(std::chrono::seconds limit) {
    End end{beast::buffers_to_string(buffer_.data()), {}};
    buffer_.clear();
    Tcp().expires_after(limit);
    std::vector<char> chunk(size_t{1} << 16);
    std::function<void()> next = [&] {
      With([&](auto& s) {
        s.async_read_some(net::buffer(chunk), [&](beast::error_code ec, size_t n) {
          end.bytes.append(chunk.data(), n);
          if (ec) {
            end.ec = ec;
            return;
          }
          next();
        });
      });
    };
    next();
    ioc_.run();
    ioc_.restart();
    return end;
  }

 private:
  beast::tcp_stream& Tcp() { return tls_ ? beast::get_lowest_layer(*tls_) : *plain_; }
  template <typename F>
  void With(F f) {
    if (tls_) {
      f(*tls_);
    } else {
      f(*plain_);
    }
  }

  net::io_context ioc_;
  ssl::context context_{ssl::context::tls_client};
  std::optional<beast::tcp_stream> plain_;
  std::optional<beast::ssl_stream<beast::tcp_stream>> tls_;
  beast::flat_buffer buffer_;
};

// The server closed the connection: an end of stream (over TLS without close_notify: truncated).
bool Closed(const beast::error_code& ec) {
  return ec == net::error::eof || ec == ssl::error::stream_truncated ||
         ec == net::error::connection_reset;
}

// The same behaviour over plain TCP and TLS.
class HttpDeadlineTest : public HttpDisconnectTest, public ::testing::WithParamInterface<bool> {
 protected:
  bool Tls() const { return GetParam(); }
  // A 25-token request (0.5 s) on `client`: while it runs, a CRLF (kept by the disconnect
  // watch) and over TLS a KeyUpdate request before it. Its response is read and checked.
  void ServeOneRequest(Client& client) {
    client.Write(Completion(25));
    ASSERT_TRUE(Eventually([&] { return service_.starts.load() == 1; }));
    if (Tls()) {
      ASSERT_TRUE(client.RequestKeyUpdate());
    }
    client.Write("\r\n");
    const auto res = client.ReadResponse();
    ASSERT_EQ(res.result_int(), 200) << res.body();
    EXPECT_EQ(nlohmann::json::parse(res.body())["usage"]["completion_tokens"], 25);
  }
};

INSTANTIATE_TEST_SUITE_P(PlainAndTls, HttpDeadlineTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "Tls" : "Plain";
                         });

// An idle keep-alive connection is closed by header_timeout (0.5 s), whatever write_timeout is
// (2 min here): the response's write deadline does not carry over onto the next request's read.
TEST_P(HttpDeadlineTest, IdleKeepAliveConnectionClosesAtTheHeaderTimeout) {
  HttpServerOptions options;
  options.header_timeout = std::chrono::milliseconds(500);
  options.write_timeout = std::chrono::minutes(2);
  StartServer(Tls(), options);
  const auto started = std::chrono::steady_clock::now();
  Client client(server_->port(), Tls());
  ServeOneRequest(client);
  const Client::End end = client.ReadToEnd(std::chrono::seconds(30));
  EXPECT_TRUE(Closed(end.ec)) << end.ec.message();
  EXPECT_EQ(end.bytes, "");
  // The deadline starts after the response went out, so after `started`.
  EXPECT_GE(std::chrono::steady_clock::now() - started, options.header_timeout);
}

// The other way round: with write_timeout 0.2 s and header_timeout 2 min, a connection idle for
// 2 s after its response is still open and serves its next request.
TEST_P(HttpDeadlineTest, IdleKeepAliveConnectionOutlivesTheWriteTimeout) {
  HttpServerOptions options;
  options.header_timeout = std::chrono::minutes(2);
  options.write_timeout = std::chrono::milliseconds(200);
  StartServer(Tls(), options);
  Client client(server_->port(), Tls());
  ServeOneRequest(client);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  client.Write(Completion(2));
  const auto res = client.ReadResponse();
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_EQ(nlohmann::json::parse(res.body())["choices"][0]["text"], "t0 t1");
  EXPECT_EQ(service_.finished.load(), 2);
}

// A client that stops reading a 16 MB response (a 4 KiB receive buffer, no reads for 2 s) is
// closed at write_timeout (0.2 s), not left to header_timeout (2 min).
TEST_P(HttpDeadlineTest, ReaderThatStopsIsClosedAtTheWriteTimeout) {
  service_.metrics = std::string(size_t{16} << 20, 'm');
  HttpServerOptions options;
  options.header_timeout = std::chrono::minutes(2);
  options.write_timeout = std::chrono::milliseconds(200);
  StartServer(Tls(), options);
  Client client(server_->port(), Tls(), /*receive_buffer_bytes=*/4096);
  client.Write("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const Client::End end = client.ReadToEnd(std::chrono::seconds(60));
  EXPECT_TRUE(Closed(end.ec)) << end.ec.message();
  EXPECT_GT(end.bytes.size(), 0u);
  EXPECT_LT(end.bytes.size(), service_.metrics.size());
}

// RFC 9112 2.2: a CRLF that arrives on its own once a response is out (the next read, not the
// disconnect watch, takes it) is skipped; the request after it is served.
TEST_P(HttpDeadlineTest, CrlfArrivingAfterTheResponseIsSkipped) {
  StartServer(Tls());
  Client client(server_->port(), Tls());
  client.Write(Completion(2));
  ASSERT_EQ(client.ReadResponse().result_int(), 200);
  client.Write("\r\n");
  // Not a condition of the outcome: gives the server the chance to read the CRLF alone.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  client.Write(Completion(3));
  const auto res = client.ReadResponse();
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_EQ(nlohmann::json::parse(res.body())["choices"][0]["text"], "t0 t1 t2");
}

// Up to 8 empty lines before a request line are skipped; a 9th goes to the parser (400).
TEST_F(HttpDisconnectTest, AtMostEightEmptyLinesAreSkipped) {
  StartServer(/*tls=*/false);
  const std::string health = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  std::string lines;
  for (int i = 0; i < 8; ++i) lines += "\r\n";
  Client eight(server_->port(), /*tls=*/false);
  eight.Write(lines + health);
  EXPECT_EQ(eight.ReadResponse().result_int(), 200);
  Client nine(server_->port(), /*tls=*/false);
  nine.Write(lines + "\n" + health);
  const auto res = nine.ReadResponse();
  EXPECT_EQ(res.result_int(), 400);
  EXPECT_NE(res.body().find("malformed HTTP request"), std::string::npos) << res.body();
}

// Installs a logger that keeps the last lines at debug level; the previous one comes back after.
class CapturedLog {
 public:
  CapturedLog()
      : lines_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256)),
        previous_(spdlog::default_logger()) {
    auto logger = std::make_shared<spdlog::logger>("captured", lines_);
    logger->set_level(spdlog::level::debug);
    spdlog::set_default_logger(logger);
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  bool Has(std::string_view text) const {
    for (const auto& line : lines_->last_formatted()) {
      if (line.find(text) != std::string::npos) return true;
    }
    return false;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> lines_;
  std::shared_ptr<spdlog::logger> previous_;
};

// With allow_half_close, a stream whose client half-closed before its first event says
// "Connection: close" and the connection closes after it. The first token waits until the
// server has logged the half-close.
TEST_F(HttpDisconnectTest, StreamToAHalfClosedClientSaysConnectionClose) {
  CapturedLog log;
  service_.hold_first_token = true;
  HttpServerOptions options;
  options.allow_half_close = true;
  StartServer(/*tls=*/false, options);
  Client client(server_->port(), /*tls=*/false);
  client.Write(Completion(2, /*stream=*/true));
  client.ShutdownSend();
  ASSERT_TRUE(Eventually([&] { return log.Has("client half-closed"); }));
  service_.first_token.Notify();
  const Client::End end = client.ReadToEnd(std::chrono::seconds(30));
  EXPECT_EQ(end.ec, net::error::eof) << end.ec.message();
  const std::string& out = end.bytes;
  const size_t head_end = out.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos) << out;
  const std::string head = out.substr(0, head_end);
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_NE(head.find("Connection: close"), std::string::npos) << head;
  EXPECT_NE(out.find("data: [DONE]"), std::string::npos) << out;
  EXPECT_EQ(service_.finished.load(), 1);
}

// A write deadline that fires as the response write completes closes the connection before the
// write's handler runs; that handler, seeing its write done, went on to the next request's read
// and armed its header deadline on the closed connection, which kept the session for
// header_timeout (httprev62 reproduced 41-53 of 60 kept for 20 s with the server built with
// ASan; without it the race did not show here, so this test guards the property, not that
// race). Nothing may hold a closed connection: every session is gone soon after its client
// leaves, whatever header_timeout is.
class HttpSessionReleaseTest : public HttpDisconnectTest,
                               public ::testing::WithParamInterface<bool> {};
INSTANTIATE_TEST_SUITE_P(PlainAndTls, HttpSessionReleaseTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "Tls" : "Plain";
                         });

struct DripResult {
  std::string read;
  beast::error_code ec;
  std::chrono::milliseconds took{0};
  size_t sent = 0;
};

// Writes `bytes` `step` at a time, `gap` apart, while reading everything until the peer ends or
// `limit` passes (ec = timeout then).
template <class Stream>
DripResult DripRequest(net::io_context& ioc, Stream& s, const std::string& bytes,
                       std::chrono::milliseconds gap, std::chrono::milliseconds limit,
                       size_t step = 1) {
  DripResult r;
  const auto start = std::chrono::steady_clock::now();
  bool done = false;
  net::steady_timer timer(ioc);
  net::steady_timer guard(ioc);
  size_t i = 0;
  std::vector<char> chunk(size_t{1} << 16);
  std::function<void()> write_next = [&] {
    if (done || i >= bytes.size()) return;
    const size_t n = std::min(step, bytes.size() - i);
    net::async_write(s, net::buffer(&bytes[i], n), [&, n](beast::error_code ec, size_t) {
      if (ec || done) return;
      i += n;
      r.sent = i;
      timer.expires_after(gap);
      timer.async_wait([&](beast::error_code ec2) {
        if (!ec2) write_next();
      });
    });
  };
  std::function<void()> read_next = [&] {
    s.async_read_some(net::buffer(chunk), [&](beast::error_code ec, size_t n) {
      r.read.append(chunk.data(), n);
      if (ec) {
        if (!done) {
          r.ec = ec;
          r.took = std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::steady_clock::now() - start);
        }
        done = true;
        timer.cancel();
        guard.cancel();
        return;
      }
      read_next();
    });
  };
  guard.expires_after(limit);
  guard.async_wait([&](beast::error_code ec) {
    if (ec) return;
    done = true;
    r.ec = beast::error::timeout;
    r.took = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    beast::get_lowest_layer(s).close();
    timer.cancel();
  });
  write_next();
  read_next();
  ioc.run();
  ioc.restart();
  return r;
}

// A plain or TLS connection for DripRequest.
struct DripConnection {
  DripConnection(uint16_t port, bool tls) {
    if (tls) {
      context.load_verify_file(kTls + "/ca.pem");
      context.set_verify_mode(ssl::verify_peer);
      tls_s.emplace(ioc, context);
      beast::get_lowest_layer(*tls_s).connect({net::ip::make_address("127.0.0.1"), port});
      tls_s->handshake(ssl::stream_base::client);
    } else {
      plain.emplace(ioc);
      plain->connect({net::ip::make_address("127.0.0.1"), port});
    }
  }
  DripResult Drip(const std::string& bytes, std::chrono::milliseconds gap,
                  std::chrono::milliseconds limit, size_t step = 1) {
    if (tls_s) return DripRequest(ioc, *tls_s, bytes, gap, limit, step);
    return DripRequest(ioc, *plain, bytes, gap, limit, step);
  }
  net::io_context ioc;
  ssl::context context{ssl::context::tls_client};
  std::optional<beast::tcp_stream> plain;
  std::optional<beast::ssl_stream<beast::tcp_stream>> tls_s;
};

TEST_P(HttpSessionReleaseTest, ClosedConnectionsAreReleasedWhenTheWriteDeadlineRacesTheWrite) {
  HttpServerOptions options;
  options.header_timeout = std::chrono::seconds(60);
  options.write_timeout = std::chrono::milliseconds(1);
  StartServer(GetParam(), options);
  for (int i = 0; i < 12; ++i) {
    DripConnection connection(server_->port(), GetParam());
    // The request in one write, then what comes back for 300 ms (or until the server closes).
    connection.Drip(Completion(1), std::chrono::milliseconds(0), std::chrono::milliseconds(300),
                    size_t{1} << 20);
  }
  // Eventually waits up to 5 s, far below header_timeout.
  EXPECT_TRUE(Eventually([&] { return server_->SessionObjects() == 0; }))
      << server_->SessionObjects() << " sessions alive after their clients left";
}

}  // namespace
}  // namespace pdserve::frontend
