// The OpenAI-compatible HTTP/1.1 server (Boost.Beast on Asio): /v1/completions,
// /v1/chat/completions (JSON or SSE streams ending with "data: [DONE]"), /v1/models, /health,
// /ready and /metrics, in front of a GenerationService.
//
// Event-driven: a few I/O threads hold thousands of concurrent streams. A client that
// disconnects (also mid-stream, also while waiting for a non-streamed answer) cancels its
// Generation at once. Bodies over max_body_bytes get 413; errors use the OpenAI error JSON. A
// stream's header is sent with its first event, so a request that fails before producing
// anything (a full pool behind the router: 429) still gets its status and a JSON error body.
// HTTP/1.0 clients get their stream unframed (no chunked encoding), ended by closing. `host` may
// be an address or a name (resolved once at Start).
//
// Thread-safety: Start() and Stop() from one controlling thread; the service is called from the
// I/O threads (and Start from the prepare threads) and must be thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/api_keys.h"
#include "common/progress_heartbeat.h"
#include "frontend/generation_service.h"

namespace pdserve::frontend {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0: pick a free port (see HttpServer::port())
  int io_threads = 2;
  // Threads that run the service's Start (tokenizing the prompt, admission) off the I/O threads,
  // so a prompt of megabytes holds up no other connection. At least 1.
  int prepare_threads = 2;
  size_t max_body_bytes = 4 << 20;
  // Connections beyond this are closed at accept.
  size_t max_connections = 16384;
  // Bytes of request bodies received and not yet handed to the service, all connections
  // together, counted as they arrive: a request whose bytes would go beyond it gets 503
  // server_busy instead of buffering without bound (announcing a large body and sending nothing
  // holds nothing). Raised to max_body_bytes when below it.
  size_t max_buffered_body_bytes = size_t{256} << 20;
  // A connection must deliver a request's headers within header_timeout of the previous
  // response (or of its opening), and the body within body_timeout after the headers (slowloris).
  // A request cut off part way gets 408 (OpenAI-style JSON, code "request_timeout") and the
  // connection closes; an idle keep-alive connection that sent nothing is closed silently.
  std::chrono::milliseconds header_timeout{30000};
  std::chrono::milliseconds body_timeout{60000};
  // A response write (a JSON body, a stream's header or event) the client does not take within
  // write_timeout closes the connection and cancels its request: a client that stops reading
  // would otherwise hold its response (up to a whole body) and the connection forever.
  std::chrono::milliseconds write_timeout{60000};
  // A stream's events wait in the server's memory while its client takes them. Past
  // stream_queue_bytes queued, the client must still be taking them: a stream whose client has
  // taken nothing (no write completed, no more bytes acknowledged) for twice its longest pause
  // so far, within one to two stream_stall_timeouts, is ended (stalled). A client that reads, but
  // slower than the stream is produced, goes on until max_stream_queue_bytes are queued (the
  // memory bound of one stream), then is ended too (too slow). Either way the stream ends at an
  // event boundary with an error event (code "stream_stalled" / "stream_too_slow") and the end of
  // the body; the events not yet started are dropped, and the request is cancelled
  // (docs/operations.md, "Slow stream readers"). max_stream_queue_bytes is raised to
  // stream_queue_bytes when below it.
  size_t stream_queue_bytes = size_t{8} << 20;
  size_t max_stream_queue_bytes = size_t{64} << 20;
  std::chrono::milliseconds stream_stall_timeout{10000};
  // What end of stream from a client whose request is running means (docs/operations.md,
  // "Half-closed clients"). false: the client is gone, its request is cancelled at once (also
  // one still waiting for a prepare thread, which then costs no Start). true: the client may
  // have half-closed (shutdown(SHUT_WR), `nc -N`) and still read: the request goes on, the
  // connection closes after its response, and a client that really left is found by the first
  // write that fails. A reset (RST) cancels at once either way.
  bool allow_half_close = false;
  // With keys: every /v1/... request needs `Authorization: Bearer <key>` naming one of them, else
  // 401 invalid_api_key before its body is parsed (docs/security.md). /health, /ready and /metrics
  // stay open to probes and Prometheus.
  std::shared_ptr<const common::ApiKeys> api_keys;
  // Both set: HTTPS (TLS 1.2 or later) with this PEM certificate chain and private key.
  std::string tls_cert_file;
  std::string tls_key_file;
  // When set, a timer on the I/O threads beats it every 100 ms: the event loop's progress for
  // the systemd watchdog (it stops when no I/O thread is free to run a handler).
  // REQUIRES: outlives the server.
  ProgressHeartbeat* heartbeat = nullptr;
};

class HttpServer {
 public:
  // Binds and starts serving. Errors: InvalidArgument when the host does not resolve or the TLS
  // certificate or key cannot be used, Unavailable when the address cannot be bound.
  // REQUIRES: `service` outlives the server.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           GenerationService* service);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const;
  // Connection objects alive: one per open connection, and a closed one's until the last
  // handler pending on it has run. Thread-safe. (Tests check that nothing keeps a closed
  // connection, e.g. a timer armed after its close.)
  int64_t SessionObjects() const;
  // Graceful shutdown, before Stop(): stops accepting, waits up to `grace` for the requests in
  // flight to finish, then ends those still running with a 503 (an SSE error event on a started
  // stream, written whole) and waits (bounded, 2 s) for those connections to close.
  void Drain(std::chrono::milliseconds grace);
  // Stops accepting, cancels every request in flight and joins the I/O threads. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::frontend
