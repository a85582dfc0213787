// The seam between the HTTP front and whatever generates tokens: the colocated engine
// (`pdserve serve`) or the router that drives prefill and decode workers (`pdserve router`).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "frontend/api_request.h"
#include "frontend/api_response.h"

namespace pdserve::frontend {

// Receives one request's output. The service calls it from its own threads, in order for each
// choice, and ends with exactly one OnComplete() or OnError(). Implementations are thread-safe.
class GenerationSink {
 public:
  virtual ~GenerationSink() = default;
  virtual void OnDelta(ChoiceDelta delta) = 0;
  virtual void OnComplete(Usage usage) = 0;
  // The request failed after it started (worker lost, isolation check failed, ...). A stream
  // that already sent text ends with an error event, never with a truncated success.
  virtual void OnError(ApiError error) = 0;
};

// A started request. Cancel() (or destruction) aborts its work on every worker it touches; the
// sink may still receive calls already under way, then none.
class Generation {
 public:
  virtual ~Generation() = default;
  virtual void Cancel() = 0;
};

using StartResult = std::variant<std::unique_ptr<Generation>, ApiError>;

class GenerationService {
 public:
  virtual ~GenerationService() = default;
  // Names accepted in the request's "model" field; the first is the served model's.
  virtual std::vector<std::string> ModelNames() const = 0;
  // Starts `req`. Errors known before starting come back as ApiError: 400
  // context_length_exceeded, 429 / 503 when queues or pools are full.
  virtual StartResult Start(const ApiRequest& req, std::shared_ptr<GenerationSink> sink) = 0;
  // The ids /v1/models and gRPC ListModels list: each served name once, no filesystem path
  // (ModelNames() may hold aliases). Default: ModelNames().
  virtual std::vector<std::string> ListedModelNames() const { return ModelNames(); }
  // The served model's context length in tokens (prompt + completion), listed by /v1/models as
  // "max_model_len" (vLLM's field); 0: unknown, not listed.
  virtual int64_t MaxModelLength() const { return 0; }
  // A request a front refused before Start() (unparsable or invalid body: 400, unknown model:
  // 404), so the service's request counter sees every finished request. Default: nothing.
  virtual void RecordRejected(Endpoint /*endpoint*/, Front /*front*/, int /*http_status*/) {}
  // A request the HTTP layer refused before it was read whole or parsed (413 body too large,
  // 431 headers too large, 408 cut off, 400 malformed HTTP, 503 body budget): `endpoint` is the
  // one its request line named, nullopt when that did not arrive or parse. Default: known
  // endpoints as RecordRejected, the others not at all.
  virtual void RecordRefused(std::optional<Endpoint> endpoint, int http_status) {
    if (endpoint) RecordRejected(*endpoint, Front::kHttp, http_status);
  }
  // A started stream the HTTP or gRPC front ended because its client did not keep up with it
  // (HttpServerOptions::stream_queue_bytes): `reason` "stream_stalled" or "stream_too_slow". The
  // request is also cancelled (and counted as such). Default: nothing.
  virtual void RecordStreamEnded(Endpoint /*endpoint*/, Front /*front*/,
                                 const std::string& /*reason*/) {}
  // /ready: true when the service can serve a request now.
  virtual bool Ready() const = 0;
  // /metrics body (Prometheus text format).
  virtual std::string MetricsText() const = 0;
};

}  // namespace pdserve::frontend
