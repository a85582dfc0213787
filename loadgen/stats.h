// Latency statistics of a benchmark run: per-request samples, exact percentiles, goodput under
// an SLO, and the run's summary (the numbers `pdserve bench` prints and writes as JSON).
//
// Definitions (as in vLLM's benchmarks/benchmark_serving.py, which most published serving
// numbers use, so ours compare directly):
// - TTFT: request sent -> first content chunk received.
// - ITL: gap between consecutive content chunks of one request (every gap is one sample).
// - TPOT: per request, (E2E - TTFT) / (output_tokens - 1), for requests with > 1 output token.
// - E2E: request sent -> stream finished.
// - Goodput: completed requests per second whose TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms
//   (a request with one output token has no TPOT and meets that half of the SLO).
// All times are seconds unless a name ends in _ms.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace pdserve::loadgen {

// What one request measured. `error_kind` empty means it completed.
struct RequestSample {
  std::string error_kind;  // "", "connect", "http_429", "stream_error", "timeout", ...
  std::string error_detail;
  double ttft_s = 0;
  double e2e_s = 0;
  std::vector<double> itl_s;  // one per gap between content chunks
  int64_t input_tokens = 0;   // from usage when the server reports it, else 0
  int64_t output_tokens = 0;  // usage.completion_tokens, else the number of content chunks
  std::string text;           // concatenated content
  std::vector<std::string> token_texts;  // one per generated token, when logprobs were returned
  bool ok() const { return error_kind.empty(); }
  std::optional<double> TpotS() const;
};

// The p-th percentile (0 <= p <= 100) of `values` by linear interpolation between closest ranks
// (numpy.percentile's default "linear" method): rank = p/100 * (n-1). Empty input gives 0.
double Percentile(std::vector<double> values, double p);

struct LatencySummary {
  double mean_ms = 0;
  double p50_ms = 0;
  double p90_ms = 0;
  double p99_ms = 0;
  double max_ms = 0;
  int64_t count = 0;
};
// Summary of values given in seconds, reported in milliseconds.
LatencySummary Summarize(const std::vector<double>& values_s);

struct Slo {
  double ttft_ms = 0;
  double tpot_ms = 0;
};
// True when a completed sample meets `slo` (see the header comment).
bool MeetsSlo(const RequestSample& sample, const Slo& slo);

struct RunSummary {
  double duration_s = 0;
  int64_t completed = 0;
  int64_t failed = 0;
  std::map<std::string, int64_t> errors;  // by kind
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  double request_throughput = 0;       // completed requests / s
  double output_token_throughput = 0;  // output tokens / s
  double total_token_throughput = 0;   // (input + output) tokens / s
  std::optional<Slo> slo;
  int64_t good_requests = 0;
  double goodput = 0;  // good requests / s
  LatencySummary ttft, tpot, itl, e2e;
};

// Summarizes `samples` collected over `duration_s` wall seconds. REQUIRES: duration_s > 0.
RunSummary Summarize(const std::vector<RequestSample>& samples, double duration_s,
                     std::optional<Slo> slo);

nlohmann::json ToJson(const RunSummary& summary);
// A human-readable table, one metric per line.
std::string ToTable(const RunSummary& summary);

}  // namespace pdserve::loadgen
