// A small HTTP/1.1 endpoint (Boost.Beast on Asio) for processes that serve no OpenAI API: the
// prefill and decode workers. GET (or HEAD) /metrics answers the Prometheus text exposition the
// caller renders (Content-Type "text/plain; version=0.0.4"), /health answers 200
// {"status":"ok"} while the process runs, /ready 200 {"status":"ready"} or 503
// {"status":"not ready"}; another method gets 405, another path 404 (a JSON error body). The
// router and `pdserve serve` answer the same three paths from frontend::HttpServer.
//
// One I/O thread; a request is read whole (at most 64 KiB of headers and body) within
// `request_timeout`, else the connection closes, so a slow or silent client holds nothing.
//
// Thread-safety: Start(), StopAccepting() and Stop() from one controlling thread; the handlers are
// called from the I/O thread and must be thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pdserve::metrics {

struct MetricsHttpOptions {
  std::string host = "127.0.0.1";  // an address or a name (resolved once at Start)
  uint16_t port = 0;               // 0: pick a free port (see MetricsHttpServer::port())
  std::chrono::milliseconds request_timeout{10000};
};

struct MetricsHttpHandlers {
  std::function<std::string()> metrics_text;  // the /metrics body; empty: an empty body
  std::function<bool()> ready;                // /ready; empty: always ready
};

class MetricsHttpServer {
 public:
  // Binds and starts serving. Errors: InvalidArgument when the host does not resolve,
  // Unavailable when the address cannot be bound or the process has no file descriptor left for
  // the event loop. A failed accept later (out of descriptors) is logged and retried after
  // 100 ms.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const MetricsHttpOptions& options,
                                                                  MetricsHttpHandlers handlers);
  ~MetricsHttpServer();  // Stop()
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  uint16_t port() const;
  // Closes the listening socket (a draining process: the port is free for its replacement when
  // this returns); connections already open are still served until Stop(). Idempotent.
  void StopAccepting();
  // Stops accepting, closes every connection and joins the I/O thread. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartOrThrow(
      const MetricsHttpOptions& options, MetricsHttpHandlers handlers);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::metrics
