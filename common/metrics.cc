#include "common/metrics.h"

#include <charconv>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/version.h"

namespace pdserve::metrics {
namespace {

void AtomicAdd(std::atomic<double>& target, double delta) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + delta, std::memory_order_relaxed)) {
  }
}

bool IsMetricName(const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool IsLabelName(const std::string& s) {
  return IsMetricName(s) && s.find(':') == std::string::npos && s.rfind("__", 0) != 0;
}

// Prometheus text format: label values escape backslash, double quote and newline; HELP text
// escapes backslash and newline.
std::string Escape(const std::string& s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round-trip form
  return std::string(buf, end);
}

std::string LabelSet(const std::vector<std::string>& names, const std::vector<std::string>& values,
                     const std::string& extra_name = "", const std::string& extra_value = "") {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", names[i], "=\"", Escape(values[i], true), "\"");
  }
  if (!extra_name.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : ",", extra_name, "=\"", extra_value, "\"");
  }
  return out.empty() ? "" : absl::StrCat("{", out, "}");
}

}  // namespace

void Counter::Increment(double delta) {
  if (delta > 0) AtomicAdd(value_, delta);
}

void Gauge::Add(double delta) { AtomicAdd(value_, delta); }

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      counts_(new std::atomic<uint64_t>[upper_bounds_.size() + 1]) {
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;
  size_t i = 0;
  while (i < upper_bounds_.size() && v > upper_bounds_[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

std::vector<double> LatencyBucketsSeconds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,   0.25,  0.5,
          1.0,   2.5,    5.0,   10.0, 25.0,  50.0, 100.0, 250.0, 600.0};
}

absl::Status Registry::CheckNew(const std::string& name,
                                const std::vector<std::string>& label_names, bool histogram) const {
  if (!IsMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid metric name '", name, "'"));
  }
  if (entries_.count(name)) {
    return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' registered twice"));
  }
  for (const auto& l : label_names) {
    if (!IsLabelName(l) || (histogram && l == "le")) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid label name '", l, "' on metric '", name, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(const std::string& name,
                                                      const std::string& help,
                                                      std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names, false); !s.ok()) return s;
  Entry& e = entries_[name];
  e.type = MetricType::kCounter;
  e.help = help;
  e.label_names = label_names;
  e.counter.reset(new Family<Counter>(std::move(label_names), {}));
  return e.counter.get();
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names, false); !s.ok()) return s;
  Entry& e = entries_[name];
  e.type = MetricType::kGauge;
  e.help = help;
  e.label_names = label_names;
  e.gauge.reset(new Family<Gauge>(std::move(label_names), {}));
  return e.gauge.get();
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(const std::string& name,
                                                          const std::string& help,
                                                          std::vector<std::string> label_names,
                                                          std::vector<double> upper_bounds) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names, true); !s.ok()) return s;
  for (size_t i = 0; i < upper_bounds.size(); ++i) {
    if (!std::isfinite(upper_bounds[i]) || (i > 0 && upper_bounds[i] <= upper_bounds[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram '", name, "' bounds must be finite and strictly increasing"));
    }
  }
  Entry& e = entries_[name];
  e.type = MetricType::kHistogram;
  e.help = help;
  e.label_names = label_names;
  e.histogram.reset(new Family<Histogram>(std::move(label_names), std::move(upper_bounds)));
  return e.histogram.get();
}

std::string Registry::Serialize() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, e] : entries_) {
    const char* type = e.type == MetricType::kCounter ? "counter"
                       : e.type == MetricType::kGauge ? "gauge"
                                                      : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", Escape(e.help, false), "\n");
    absl::StrAppend(&out, "# TYPE ", name, " ", type, "\n");
    if (e.counter) {
      for (const auto& [labels, c] : e.counter->Series()) {
        absl::StrAppend(&out, name, LabelSet(e.label_names, labels), " ", FormatValue(c->Value()),
                        "\n");
      }
    } else if (e.gauge) {
      for (const auto& [labels, g] : e.gauge->Series()) {
        absl::StrAppend(&out, name, LabelSet(e.label_names, labels), " ", FormatValue(g->Value()),
                        "\n");
      }
    } else {
      for (const auto& [labels, h] : e.histogram->Series()) {
        uint64_t cumulative = 0;
        const auto& bounds = h->upper_bounds();
        for (size_t i = 0; i <= bounds.size(); ++i) {
          cumulative += h->BucketCount(i);
          const std::string le = i < bounds.size()
                                     ? FormatValue(bounds[i])
                                     : FormatValue(std::numeric_limits<double>::infinity());
          absl::StrAppend(&out, name, "_bucket", LabelSet(e.label_names, labels, "le", le), " ",
                          cumulative, "\n");
        }
        absl::StrAppend(&out, name, "_sum", LabelSet(e.label_names, labels), " ",
                        FormatValue(h->Sum()), "\n");
        absl::StrAppend(&out, name, "_count", LabelSet(e.label_names, labels), " ", cumulative,
                        "\n");
      }
    }
  }
  return out;
}

absl::Status AddBuildInfo(Registry& registry, const std::string& role) {
  absl::StatusOr<Family<Gauge>*> build_info =
      registry.AddGauge("pdserve_build_info", "Identifies the process.", {"role", "version"});
  if (!build_info.ok()) return build_info.status();
  (*build_info)->WithLabels({role, kVersion}).Set(1);
  return absl::OkStatus();
}

}  // namespace pdserve::metrics
