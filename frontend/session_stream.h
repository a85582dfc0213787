// The byte stream under one HTTP connection of frontend::HttpServer: plain TCP, or TLS over TCP
// when the server has a certificate (HttpServerOptions::tls_cert_file). Either way the same
// beast::tcp_stream sits at the bottom, so socket-level calls (shutdown, cancel, close, TCP_INFO)
// work unchanged through tcp(). Its expiry (expires_after) is left unset: the server keeps its
// deadlines on timers of its own (frontend/http_server.cc, Session::ArmReadTimer).
//
// It is an AsyncReadStream / AsyncWriteStream for Beast's HTTP operations; its completion
// handlers must be plain callables (the server passes lambdas and Beast's composed operations;
// no futures or coroutines). Thread-safety: as beast::tcp_stream: one strand.
#pragma once

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <optional>
#include <utility>

namespace pdserve::frontend {

class SessionStream {
 public:
  using executor_type = boost::beast::tcp_stream::executor_type;

  // Plain TCP.
  explicit SessionStream(boost::asio::ip::tcp::socket socket) : plain_(std::move(socket)) {}
  // TLS with `context`, which must outlive the stream; Handshake() before any read.
  SessionStream(boost::asio::ip::tcp::socket socket, boost::asio::ssl::context& context)
      : tls_(std::in_place, std::move(socket), context) {}

  bool tls() const { return tls_.has_value(); }
  boost::beast::tcp_stream& tcp() { return tls_ ? boost::beast::get_lowest_layer(*tls_) : *plain_; }
  executor_type get_executor() { return tcp().get_executor(); }

  // The server side of the TLS handshake; completes at once (success) on a plain stream.
  template <typename Handler>
  void Handshake(Handler&& handler) {
    if (!tls_) {
      return boost::asio::post(get_executor(), [h = std::forward<Handler>(handler)]() mutable {
        h(boost::beast::error_code());
      });
    }
    tls_->async_handshake(boost::asio::ssl::stream_base::server, std::forward<Handler>(handler));
  }

  template <typename Buffers, typename Handler>
  void async_read_some(const Buffers& buffers, Handler&& handler) {
    if (tls_) {
      tls_->async_read_some(buffers, std::forward<Handler>(handler));
    } else {
      plain_->async_read_some(buffers, std::forward<Handler>(handler));
    }
  }
  template <typename Buffers, typename Handler>
  void async_write_some(const Buffers& buffers, Handler&& handler) {
    if (tls_) {
      tls_->async_write_some(buffers, std::forward<Handler>(handler));
    } else {
      plain_->async_write_some(buffers, std::forward<Handler>(handler));
    }
  }

 private:
  std::optional<boost::beast::tcp_stream> plain_;
  std::optional<boost::beast::ssl_stream<boost::beast::tcp_stream>> tls_;
};

}  // namespace pdserve::frontend
