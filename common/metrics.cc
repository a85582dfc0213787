#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "prometheus/check_names.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace pdserve::metrics {
namespace {

// The exposition format escapes backslash and newline in HELP text; prometheus-cpp 1.0's
// TextSerializer writes the help as given, so it is escaped here once, at registration.
std::string EscapeHelp(const std::string& help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

prometheus::Labels ToLabels(const std::vector<std::string>& names,
                            const std::vector<std::string>& values) {
  prometheus::Labels labels;
  for (size_t i = 0; i < names.size(); ++i) labels.emplace(names[i], values[i]);
  return labels;
}

bool LabelsBefore(const prometheus::ClientMetric& a, const prometheus::ClientMetric& b) {
  auto key = [](const prometheus::ClientMetric& m) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& l : m.label) out.emplace_back(l.name, l.value);
    return out;
  };
  return key(a) < key(b);
}

prometheus::ClientMetric::Histogram Snapshot(const prometheus::Histogram& h) {
  return h.Collect().histogram;
}

}  // namespace

void Counter::Increment(double delta) {
  if (delta > 0) impl_.Increment(delta);
}
double Counter::Value() const { return impl_.Value(); }

void Gauge::Set(double v) { impl_.Set(v); }
void Gauge::Add(double delta) { impl_.Increment(delta); }
double Gauge::Value() const { return impl_.Value(); }

void Histogram::Observe(double v) {
  if (!std::isnan(v)) impl_.Observe(v);
}

uint64_t Histogram::BucketCount(size_t i) const {
  const prometheus::ClientMetric::Histogram s = Snapshot(impl_);
  const uint64_t below = i == 0 ? 0 : s.bucket[i - 1].cumulative_count;
  return s.bucket[i].cumulative_count - below;
}

uint64_t Histogram::Count() const { return Snapshot(impl_).sample_count; }
double Histogram::Sum() const { return Snapshot(impl_).sample_sum; }

std::vector<double> LatencyBucketsSeconds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,   0.25,  0.5,
          1.0,   2.5,    5.0,   10.0, 25.0,  50.0, 100.0, 250.0, 600.0};
}

template <typename T>
std::unique_ptr<T> Family<T>::Create(const std::vector<std::string>& label_values) {
  const prometheus::Labels labels = ToLabels(label_names_, label_values);
  if constexpr (std::is_same_v<T, Histogram>) {
    return std::make_unique<Histogram>(impl_.Add(labels, buckets_), buckets_);
  } else {
    return std::make_unique<T>(impl_.Add(labels));
  }
}

template <typename T>
T& Family<T>::WithLabels(const std::vector<std::string>& label_values) {
  if (label_values.size() != label_names_.size()) std::abort();
  absl::MutexLock lock(&mu_);
  std::unique_ptr<T>& slot = series_[label_values];
  if (!slot) slot = Create(label_values);
  return *slot;
}

template <typename T>
void Family<T>::ExportAtZero(const std::vector<std::vector<std::string>>& values_per_label) {
  if (values_per_label.size() != label_names_.size()) std::abort();
  // Odometer over the lists: every combination once (none when a list is empty).
  std::vector<size_t> at(values_per_label.size(), 0);
  for (const auto& values : values_per_label) {
    if (values.empty()) return;
  }
  for (;;) {
    std::vector<std::string> labels;
    for (size_t i = 0; i < at.size(); ++i) labels.push_back(values_per_label[i][at[i]]);
    WithLabels(labels);
    size_t i = 0;
    while (i < at.size() && ++at[i] == values_per_label[i].size()) at[i++] = 0;
    if (i == at.size()) return;
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Registry::Registry()
    : impl_(std::make_unique<prometheus::Registry>(prometheus::Registry::InsertBehavior::Throw)) {}
Registry::~Registry() = default;

absl::Status Registry::CheckNew(const std::string& name,
                                const std::vector<std::string>& label_names, bool histogram) const {
  if (!prometheus::CheckMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid metric name '", name, "'"));
  }
  if (names_.contains(name)) {
    return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' registered twice"));
  }
  for (const auto& l : label_names) {
    if (!prometheus::CheckLabelName(l) || (histogram && l == "le")) {
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
  names_.insert(name);
  auto& impl = prometheus::BuildCounter().Name(name).Help(EscapeHelp(help)).Register(*impl_);
  counters_.emplace_back(new Family<Counter>(impl, std::move(label_names), {}));
  return counters_.back().get();
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names, false); !s.ok()) return s;
  names_.insert(name);
  auto& impl = prometheus::BuildGauge().Name(name).Help(EscapeHelp(help)).Register(*impl_);
  gauges_.emplace_back(new Family<Gauge>(impl, std::move(label_names), {}));
  return gauges_.back().get();
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
  names_.insert(name);
  auto& impl = prometheus::BuildHistogram().Name(name).Help(EscapeHelp(help)).Register(*impl_);
  histograms_.emplace_back(
      new Family<Histogram>(impl, std::move(label_names), std::move(upper_bounds)));
  return histograms_.back().get();
}

std::string Registry::Serialize() const {
  std::vector<prometheus::MetricFamily> families = impl_->Collect();
  std::sort(families.begin(), families.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& family : families) {
    std::stable_sort(family.metric.begin(), family.metric.end(), LabelsBefore);
  }
  return prometheus::TextSerializer().Serialize(families);
}

absl::Status AddBuildInfo(Registry& registry, const std::string& role) {
  absl::StatusOr<Family<Gauge>*> build_info =
      registry.AddGauge("pdserve_build_info", "Identifies the process.", {"role", "version"});
  if (!build_info.ok()) return build_info.status();
  (*build_info)->WithLabels({role, kVersion}).Set(1);
  return absl::OkStatus();
}

}  // namespace pdserve::metrics
