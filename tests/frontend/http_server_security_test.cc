// API keys and HTTPS on the HTTP front (docs/security.md), with the certificates of
// tools/make_test_certs.sh.
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/api_keys.h"
#include "frontend/http_server.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;

const std::string kTls = PDSERVE_TLS_FIXTURES;

// Answers every request with one token; counts how many requests reached Start.
class OneTokenService : public GenerationService {
 public:
  std::atomic<int> starts{0};
  std::atomic<int> rejected_401{0};
  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return "pdserve_up 1\n"; }
  void RecordRejected(Endpoint, Front, int http_status) override {
    rejected_401 += http_status == 401;
  }
  // The answer comes from another thread, after Start returned, as a real service's does.
  StartResult Start(const ApiRequest&, std::shared_ptr<GenerationSink> sink) override {
    starts++;
    threads_.emplace_back([sink] {
      ChoiceDelta delta;
      delta.text = "amen";
      delta.finish_reason = "stop";
      sink->OnDelta(std::move(delta));
      sink->OnComplete({1, 1});
    });
    return std::unique_ptr<Generation>(new NoGeneration);
  }
  ~OneTokenService() override {
    for (auto& t : threads_) t.join();
  }

 private:
  std::vector<std::thread> threads_;
  struct NoGeneration : Generation {
    void Cancel() override {}
  };
};

constexpr char kCompletion[] = R"({"model":"tiny","prompt":"In the","max_tokens":1})";

http::request<http::string_body> MakeRequest(http::verb verb, const std::string& target,
                                             const std::string& authorization,
                                             const std::string& body = kCompletion) {
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "localhost");
  req.set(http::field::content_type, "application/json");
  if (!authorization.empty()) req.set(http::field::authorization, authorization);
  if (verb == http::verb::post) req.body() = body;
  req.prepare_payload();
  return req;
}

http::response<http::string_body> Plain(uint16_t port, http::verb verb, const std::string& target,
                                        const std::string& authorization = "",
                                        const std::string& body = kCompletion) {
  net::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect({net::ip::make_address("127.0.0.1"), port});
  http::write(sock, MakeRequest(verb, target, authorization, body));
  beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(sock, buf, res);
  return res;
}

class ApiKeyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto keys = common::ApiKeys::FromText("sk-test-1\nsk-test-2\n", "keys");
    ASSERT_TRUE(keys.ok()) << keys.status();
    HttpServerOptions options;
    options.port = 0;
    options.api_keys = *keys;
    auto server = HttpServer::Start(options, &service_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override { server_->Stop(); }

  OneTokenService service_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(ApiKeyTest, NoKeyOrAWrongKeyGets401AndStartsNothing) {
  for (const std::string auth : {"", "Bearer sk-wrong", "sk-test-1", "Bearer sk-test-10"}) {
    auto res = Plain(server_->port(), http::verb::post, "/v1/completions", auth);
    EXPECT_EQ(res.result_int(), 401) << auth;
    const auto error = nlohmann::json::parse(res.body())["error"];
    EXPECT_EQ(error["code"], "invalid_api_key") << res.body();
    EXPECT_EQ(error["type"], "invalid_request_error");
  }
  EXPECT_EQ(Plain(server_->port(), http::verb::get, "/v1/models").result_int(), 401);
  EXPECT_EQ(service_.starts.load(), 0);
  EXPECT_EQ(service_.rejected_401.load(), 4);
}

TEST_F(ApiKeyTest, EitherKeyIsServed) {
  for (const std::string auth : {"Bearer sk-test-1", "Bearer sk-test-2"}) {
    auto res = Plain(server_->port(), http::verb::post, "/v1/completions", auth);
    ASSERT_EQ(res.result_int(), 200) << res.body();
    EXPECT_EQ(nlohmann::json::parse(res.body())["choices"][0]["text"], "amen");
  }
  EXPECT_EQ(Plain(server_->port(), http::verb::get, "/v1/models", "Bearer sk-test-2").result_int(),
            200);
  EXPECT_EQ(service_.starts.load(), 2);
}

TEST_F(ApiKeyTest, TwoAuthorizationHeadersAreRefusedWhateverTheirOrder) {
  for (const auto& [first, second] : {std::pair{"Bearer sk-test-1", "Bearer sk-wrong"},
                                      std::pair{"Bearer sk-wrong", "Bearer sk-test-1"},
                                      std::pair{"Bearer sk-test-1", "Bearer sk-test-1"}}) {
    net::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect({net::ip::make_address("127.0.0.1"), server_->port()});
    auto req = MakeRequest(http::verb::post, "/v1/completions", first);
    req.insert(http::field::authorization, second);
    http::write(sock, req);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(sock, buf, res);
    EXPECT_EQ(res.result_int(), 401) << first << " / " << second;
  }
  EXPECT_EQ(service_.starts.load(), 0);
}

TEST_F(ApiKeyTest, ProbesAndMetricsNeedNoKey) {
  EXPECT_EQ(Plain(server_->port(), http::verb::get, "/health").result_int(), 200);
  EXPECT_EQ(Plain(server_->port(), http::verb::get, "/ready").result_int(), 200);
  EXPECT_EQ(Plain(server_->port(), http::verb::get, "/metrics").body(), "pdserve_up 1\n");
}

class HttpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HttpServerOptions options;
    options.port = 0;
    options.tls_cert_file = kTls + "/cluster.pem";
    options.tls_key_file = kTls + "/cluster.key";
    auto server = HttpServer::Start(options, &service_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override { server_->Stop(); }

  // One request over TLS, verifying the server against `ca`. Throws on a handshake failure.
  http::response<http::string_body> Tls(const std::string& ca, http::verb verb,
                                        const std::string& target) {
    net::io_context ioc;
    ssl::context context(ssl::context::tls_client);
    context.load_verify_file(kTls + "/" + ca + ".pem");
    context.set_verify_mode(ssl::verify_peer);
    beast::ssl_stream<beast::tcp_stream> stream(ioc, context);
    beast::get_lowest_layer(stream).connect({net::ip::make_address("127.0.0.1"), server_->port()});
    stream.handshake(ssl::stream_base::client);
    http::write(stream, MakeRequest(verb, target, ""));
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(stream, buf, res);
    return res;
  }

  OneTokenService service_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpsTest, ServesOverTls) {
  EXPECT_EQ(Tls("ca", http::verb::get, "/health").result_int(), 200);
  auto res = Tls("ca", http::verb::post, "/v1/completions");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_EQ(nlohmann::json::parse(res.body())["choices"][0]["text"], "amen");
}

TEST_F(HttpsTest, AClientTrustingAnotherCaRefusesTheServer) {
  EXPECT_THROW(Tls("rogue-ca", http::verb::get, "/health"), boost::system::system_error);
  EXPECT_EQ(service_.starts.load(), 0);
}

TEST_F(HttpsTest, PlainHttpGetsNoAnswer) {
  EXPECT_THROW(Plain(server_->port(), http::verb::post, "/v1/completions"),
               boost::system::system_error);
  EXPECT_EQ(service_.starts.load(), 0);
}

// Unauthenticated bodies 100000 arrays deep, the breaker's (2026-12-04), each on
// /v1/chat/completions: a 400 naming the limit, nothing started, and the server still answers.
// Before the depth check the server's reading thread overflowed its stack and the whole process
// died.
TEST(UntrustedJsonTest, DeeplyNestedBodiesAre400AndTheServerLives) {
  OneTokenService service;
  HttpServerOptions options;
  options.port = 0;
  auto server = HttpServer::Start(options, &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string head = R"({"model":"tiny","messages":[{"role":"user","content":"hi"}],)";
  const std::string bodies[] = {
      head + R"("tools":[{"type":"function","function":{"name":"f"}}],"x":)" + deep +
          R"(,"y":1,"z":2})",
      head + R"("response_format":{"type":"json_schema","json_schema":{"name":"x","schema":)" +
          R"({"type":"string"}}},"x":)" + deep + R"(,"y":1})",
  };
  for (const std::string& body : bodies) {
    const http::response<http::string_body> res =
        Plain((*server)->port(), http::verb::post, "/v1/chat/completions", "", body);
    EXPECT_EQ(res.result_int(), 400);
    EXPECT_EQ(nlohmann::json::parse(res.body())["error"]["message"],
              "request body nests deeper than 256 JSON levels");
  }
  EXPECT_EQ(service.starts.load(), 0);
  EXPECT_EQ(Plain((*server)->port(), http::verb::post, "/v1/completions").result_int(), 200);
  (*server)->Stop();
}

TEST(HttpsStartTest, AnUnusableCertificateFailsStartNamingTheFile) {
  OneTokenService service;
  HttpServerOptions options;
  options.port = 0;
  options.tls_cert_file = kTls + "/absent.pem";
  options.tls_key_file = kTls + "/cluster.key";
  auto server = HttpServer::Start(options, &service);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("absent.pem"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::frontend
