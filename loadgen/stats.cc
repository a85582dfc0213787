#include "loadgen/stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_format.h"

namespace pdserve::loadgen {

std::optional<double> RequestSample::TpotS() const {
  if (!ok() || output_tokens <= 1) return std::nullopt;
  return (e2e_s - ttft_s) / static_cast<double>(output_tokens - 1);
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * frac;
}

LatencySummary Summarize(const std::vector<double>& values_s) {
  LatencySummary s;
  s.count = static_cast<int64_t>(values_s.size());
  if (values_s.empty()) return s;
  s.mean_ms = std::accumulate(values_s.begin(), values_s.end(), 0.0) / values_s.size() * 1e3;
  s.p50_ms = Percentile(values_s, 50) * 1e3;
  s.p90_ms = Percentile(values_s, 90) * 1e3;
  s.p99_ms = Percentile(values_s, 99) * 1e3;
  s.max_ms = *std::max_element(values_s.begin(), values_s.end()) * 1e3;
  return s;
}

bool MeetsSlo(const RequestSample& sample, const Slo& slo) {
  if (!sample.ok() || sample.ttft_s * 1e3 > slo.ttft_ms) return false;
  const std::optional<double> tpot = sample.TpotS();
  return !tpot || *tpot * 1e3 <= slo.tpot_ms;
}

RunSummary Summarize(const std::vector<RequestSample>& samples, double duration_s,
                     std::optional<Slo> slo) {
  RunSummary r;
  r.duration_s = duration_s;
  r.slo = slo;
  std::vector<double> ttft, tpot, itl, e2e;
  for (const RequestSample& s : samples) {
    if (!s.ok()) {
      ++r.failed;
      ++r.errors[s.error_kind];
      continue;
    }
    ++r.completed;
    r.input_tokens += s.input_tokens;
    r.output_tokens += s.output_tokens;
    ttft.push_back(s.ttft_s);
    e2e.push_back(s.e2e_s);
    if (auto t = s.TpotS()) tpot.push_back(*t);
    itl.insert(itl.end(), s.itl_s.begin(), s.itl_s.end());
    if (slo && MeetsSlo(s, *slo)) ++r.good_requests;
  }
  r.request_throughput = r.completed / duration_s;
  r.output_token_throughput = r.output_tokens / duration_s;
  r.total_token_throughput = (r.input_tokens + r.output_tokens) / duration_s;
  if (slo) r.goodput = r.good_requests / duration_s;
  r.ttft = Summarize(ttft);
  r.tpot = Summarize(tpot);
  r.itl = Summarize(itl);
  r.e2e = Summarize(e2e);
  return r;
}

namespace {

nlohmann::json ToJson(const LatencySummary& s) {
  return {{"mean", s.mean_ms}, {"p50", s.p50_ms}, {"p90", s.p90_ms},
          {"p99", s.p99_ms},   {"max", s.max_ms}, {"count", s.count}};
}

std::string Row(const char* name, const LatencySummary& s) {
  return absl::StrFormat("%-10s %10.2f %10.2f %10.2f %10.2f %10.2f\n", name, s.mean_ms, s.p50_ms,
                         s.p90_ms, s.p99_ms, s.max_ms);
}

}  // namespace

nlohmann::json ToJson(const RunSummary& r) {
  nlohmann::json j = {{"duration_s", r.duration_s},
                      {"completed", r.completed},
                      {"failed", r.failed},
                      {"errors", r.errors},
                      {"input_tokens", r.input_tokens},
                      {"output_tokens", r.output_tokens},
                      {"request_throughput", r.request_throughput},
                      {"output_token_throughput", r.output_token_throughput},
                      {"total_token_throughput", r.total_token_throughput},
                      {"ttft_ms", ToJson(r.ttft)},
                      {"tpot_ms", ToJson(r.tpot)},
                      {"itl_ms", ToJson(r.itl)},
                      {"e2e_ms", ToJson(r.e2e)}};
  if (r.slo) {
    j["slo"] = {{"ttft_ms", r.slo->ttft_ms}, {"tpot_ms", r.slo->tpot_ms}};
    j["good_requests"] = r.good_requests;
    j["goodput"] = r.goodput;
  }
  return j;
}

std::string ToTable(const RunSummary& r) {
  std::string out = absl::StrFormat(
      "duration %.2f s, completed %d, failed %d\n"
      "request throughput %.2f req/s, output %.1f tok/s, total %.1f tok/s (in %d, out %d)\n",
      r.duration_s, r.completed, r.failed, r.request_throughput, r.output_token_throughput,
      r.total_token_throughput, r.input_tokens, r.output_tokens);
  if (r.slo) {
    out += absl::StrFormat("goodput %.2f req/s (%d requests with TTFT <= %g ms, TPOT <= %g ms)\n",
                           r.goodput, r.good_requests, r.slo->ttft_ms, r.slo->tpot_ms);
  }
  for (const auto& [kind, count] : r.errors) {
    out += absl::StrFormat("errors %-20s %d\n", kind, count);
  }
  out +=
      absl::StrFormat("%-10s %10s %10s %10s %10s %10s\n", "ms", "mean", "p50", "p90", "p99", "max");
  out += Row("TTFT", r.ttft) + Row("TPOT", r.tpot) + Row("ITL", r.itl) + Row("E2E", r.e2e);
  return out;
}

}  // namespace pdserve::loadgen
