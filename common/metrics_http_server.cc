#include "common/metrics_http_server.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <future>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace pdserve::metrics {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

constexpr size_t kMaxRequestBytes = 64 << 10;

// OpenAI-style error body, as frontend::ApiError writes it (the messages here need no escaping).
std::string ErrorJson(std::string_view message) {
  return absl::StrCat(R"({"error":{"message":")", std::string(message),
                      R"(","type":"invalid_request_error","param":null,"code":null}})");
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const MetricsHttpHandlers& handlers,
          std::chrono::milliseconds timeout)
      : stream_(std::move(socket)), handlers_(handlers), timeout_(timeout) {}

  void Read() {
    parser_.emplace();
    parser_->body_limit(kMaxRequestBytes);
    parser_->header_limit(kMaxRequestBytes);
    stream_.expires_after(timeout_);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       if (ec) return self->Close();
                       self->Respond(self->parser_->release());
                     });
  }

 private:
  void Respond(const http::request<http::string_body>& request) {
    std::string_view target(request.target().data(), request.target().size());
    target = target.substr(0, target.find('?'));
    const bool get = request.method() == http::verb::get || request.method() == http::verb::head;
    auto res =
        std::make_shared<http::response<http::string_body>>(http::status::ok, request.version());
    res->set(http::field::server, "pdserve");
    res->set(http::field::content_type, "application/json");
    if (target != "/metrics" && target != "/health" && target != "/ready") {
      res->result(http::status::not_found);
      res->body() = ErrorJson(absl::StrCat("no route for ", std::string(target)));
    } else if (!get) {
      res->result(http::status::method_not_allowed);
      res->set(http::field::allow, "GET, HEAD");
      res->body() = ErrorJson("use GET");
    } else if (target == "/metrics") {
      res->set(http::field::content_type, "text/plain; version=0.0.4");
      if (handlers_.metrics_text) res->body() = handlers_.metrics_text();
    } else if (target == "/health") {
      res->body() = R"({"status":"ok"})";
    } else if (!handlers_.ready || handlers_.ready()) {
      res->body() = R"({"status":"ready"})";
    } else {
      res->result(http::status::service_unavailable);
      res->body() = R"({"status":"not ready"})";
    }
    res->keep_alive(request.keep_alive());
    res->prepare_payload();
    if (request.method() == http::verb::head) res->body().clear();
    stream_.expires_after(timeout_);
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        if (ec || !res->keep_alive()) return self->Close();
                        self->Read();
                      });
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const MetricsHttpHandlers& handlers_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace

struct MetricsHttpServer::Impl {
  MetricsHttpOptions options;
  MetricsHttpHandlers handlers;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  // After a failed accept (EMFILE, ENFILE, ENOBUFS: the condition lasts), the next one waits
  // kAcceptBackoff, so the loop neither spins nor floods the log (it wrote ~10^6 lines a second
  // before 2026-12-05; the HTTP front already waited).
  net::steady_timer accept_timer{io};
  std::thread thread;
  uint16_t port = 0;
  // The controlling thread's: once the acceptor is closed, io.run() returns as soon as no
  // connection is left, so a second close must not post to it (nobody would run it).
  bool accepting = true;
  bool stopped = false;

  static constexpr std::chrono::milliseconds kAcceptBackoff{100};

  void Accept() {
    acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted) return;
      if (!ec) {
        std::make_shared<Session>(std::move(socket), handlers, options.request_timeout)->Read();
        Accept();
        return;
      }
      spdlog::warn("metrics endpoint: accept failed: {}; retrying in {} ms", ec.message(),
                   kAcceptBackoff.count());
      accept_timer.expires_after(kAcceptBackoff);
      accept_timer.async_wait([this](beast::error_code timer) {
        if (timer != net::error::operation_aborted) Accept();
      });
    });
  }
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options, MetricsHttpHandlers handlers) {
  // Asio throws where the process is out of file descriptors before the acceptor exists (its
  // epoll reactor): an error to return, not an abort.
  try {
    return StartOrThrow(options, std::move(handlers));
  } catch (const boost::system::system_error& e) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint: cannot start on ", options.host,
                                               ":", options.port, ": ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::StartOrThrow(
    const MetricsHttpOptions& options, MetricsHttpHandlers handlers) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->handlers = std::move(handlers);
  beast::error_code ec;
  tcp::resolver resolver(impl->io);
  const auto endpoints = resolver.resolve(options.host, std::to_string(options.port), ec);
  if (ec || endpoints.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics endpoint: cannot resolve host '", options.host, "': ", ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint: cannot listen on ", options.host,
                                               ":", options.port, ": ", ec.message()));
  }
  impl->port = impl->acceptor.local_endpoint().port();
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl)));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

uint16_t MetricsHttpServer::port() const { return impl_->port; }

void MetricsHttpServer::StopAccepting() {
  if (impl_->stopped || !impl_->accepting) return;
  impl_->accepting = false;
  // On the I/O thread, where the pending accept lives; it ends with operation_aborted.
  std::promise<void> closed;
  net::post(impl_->io, [impl = impl_.get(), &closed] {
    beast::error_code ignored;
    impl->acceptor.close(ignored);
    impl->accept_timer.cancel();
    closed.set_value();
  });
  closed.get_future().wait();
}

void MetricsHttpServer::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  // Stopping the context drops every pending operation; the sessions (owned by their handlers)
  // and their sockets go with it.
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  beast::error_code ignored;
  impl_->acceptor.close(ignored);
}

}  // namespace pdserve::metrics
