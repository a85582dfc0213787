// Drives a benchmark run: issues streamed requests to one endpoint at a Poisson arrival rate
// and/or under a concurrency cap, and collects one RequestSample per request.
//
// Arrivals: with rate > 0, inter-arrival gaps are exponential with mean 1/rate (a Poisson
// process, seeded); arrivals that find max_concurrency requests in flight wait for a slot (as
// vLLM's benchmark does). With rate == 0 requests start as soon as a slot is free.
// Bounds: the run issues at most num_requests (0: no limit) and issues nothing after
// duration_s (0: no limit); at least one bound must be set. Requests still running at
// duration_s + drain_timeout_s fail with "timeout", so a run always ends by itself.
//
// Thread-safety: Run() blocks the calling thread and runs the whole event loop on it; the
// progress callback is called on that thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loadgen/stats.h"
#include "loadgen/stream_client.h"

namespace pdserve::loadgen {

struct RequestTemplate {
  std::string target;  // path, e.g. "/v1/completions" (the endpoint's path prefix is added)
  std::string body;
};

struct Progress {
  int64_t issued = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t in_flight = 0;
  double elapsed_s = 0;
};

struct RunOptions {
  EndpointUrl url;
  std::vector<RequestTemplate> requests;  // request i uses requests[i % size]
  double rate = 0;                        // requests/s; 0: no pacing
  int64_t max_concurrency = 0;            // 0: no cap (then rate > 0 is required)
  int64_t num_requests = 0;
  double duration_s = 0;
  double request_timeout_s = 600;
  double drain_timeout_s = 30;
  uint64_t seed = 0;
  double progress_interval_s = 0.5;
  std::function<void(const Progress&)> progress;  // optional
};

struct RunResult {
  std::vector<RequestSample> samples;  // samples[i] is the i-th request issued
  double duration_s = 0;               // run start -> last request finished
};

// Errors: InvalidArgument for unbounded or empty runs, Unavailable when the host does not
// resolve. Request failures are not errors: they are samples with error_kind set.
absl::StatusOr<RunResult> Run(const RunOptions& options);

}  // namespace pdserve::loadgen
