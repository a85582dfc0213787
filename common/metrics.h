// pdserve's metrics registry: counters, gauges and histograms with labels, kept by Prometheus's C++
// client (prometheus-cpp, Debian package prometheus-cpp-dev) and rendered by its TextSerializer in
// the Prometheus text exposition format 0.0.4 (what /metrics serves over each process's own HTTP
// server; civetweb's Exposer is not used).
//
// This header keeps the small API the processes were written against (families addressed by an
// ordered list of label values, absl::Status errors instead of exceptions); the values live in
// prometheus::Counter / Gauge / Histogram. Metric names are pdserve_* by convention
// (docs/metrics.md); the output is checked with `promtool check metrics` in the tests.
//
// Thread-safety: every method is safe to call from any thread. Families and series are created
// under a mutex and never destroyed while the registry lives, so references returned by
// Family::WithLabels() stay valid for the registry's lifetime; updating a counter or gauge is
// lock-free, a histogram observation takes the histogram's own mutex. Serialize() reads each
// series atomically; different series may come from slightly different instants.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace pdserve::metrics {

class Counter {
 public:
  explicit Counter(prometheus::Counter& impl) : impl_(impl) {}
  // REQUIRES: delta >= 0 (a negative or NaN delta is ignored: counters only go up).
  void Increment(double delta = 1.0);
  double Value() const;

 private:
  prometheus::Counter& impl_;
};

class Gauge {
 public:
  explicit Gauge(prometheus::Gauge& impl) : impl_(impl) {}
  void Set(double v);
  void Add(double delta);
  double Value() const;

 private:
  prometheus::Gauge& impl_;
};

class Histogram {
 public:
  Histogram(prometheus::Histogram& impl, std::vector<double> upper_bounds)
      : impl_(impl), upper_bounds_(std::move(upper_bounds)) {}
  // Records one observation (seconds for latencies); a value on a bound counts in that bound's
  // bucket (le is inclusive). NaN is ignored.
  void Observe(double v);
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  // Non-cumulative count of bucket i (i == upper_bounds().size() is the +Inf bucket).
  uint64_t BucketCount(size_t i) const;
  uint64_t Count() const;
  double Sum() const;

 private:
  prometheus::Histogram& impl_;
  const std::vector<double> upper_bounds_;
};

// Latency buckets from 1 ms to 600 s (seconds), roughly x2.5 apart: the router's TTFT, ITL, TPOT,
// end-to-end and queue-time histograms use them.
std::vector<double> LatencyBucketsSeconds();

// All series of one metric name, one per distinct label-value tuple.
template <typename T>
class Family {
 public:
  // The series for `label_values` (same order as the family's label names), created at 0 on
  // first use. REQUIRES: label_values.size() == number of label names (else the call aborts: a
  // programming error, not an input error).
  T& WithLabels(const std::vector<std::string>& label_values);
  // The series with no labels. REQUIRES: the family has no label names.
  T& Get() { return WithLabels({}); }
  // Creates (at 0) the series of every combination of `values_per_label` (one list per label
  // name, in the family's label order), so that /metrics shows them before their first event
  // and PromQL's increase() sees that event. REQUIRES: one list per label name.
  void ExportAtZero(const std::vector<std::vector<std::string>>& values_per_label);
  const std::vector<std::string>& label_names() const { return label_names_; }

 private:
  friend class Registry;
  using Impl = std::conditional_t<
      std::is_same_v<T, Counter>, prometheus::Family<prometheus::Counter>,
      std::conditional_t<std::is_same_v<T, Gauge>, prometheus::Family<prometheus::Gauge>,
                         prometheus::Family<prometheus::Histogram>>>;
  Family(Impl& impl, std::vector<std::string> label_names, std::vector<double> buckets)
      : impl_(impl), label_names_(std::move(label_names)), buckets_(std::move(buckets)) {}
  // A new series of `impl_` with these labels (defined in metrics.cc per T).
  std::unique_ptr<T> Create(const std::vector<std::string>& label_values);

  Impl& impl_;
  const std::vector<std::string> label_names_;
  const std::vector<double> buckets_;  // histograms only
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> series_ ABSL_GUARDED_BY(mu_);
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registers a metric family. Errors (InvalidArgument): a name or label name that is not a
  // valid Prometheus identifier, a reserved label name ("le" on histograms, "__*"), a duplicate
  // metric name, histogram bounds that are not strictly increasing and finite.
  absl::StatusOr<Family<Counter>*> AddCounter(const std::string& name, const std::string& help,
                                              std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Gauge>*> AddGauge(const std::string& name, const std::string& help,
                                          std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Histogram>*> AddHistogram(const std::string& name, const std::string& help,
                                                  std::vector<std::string> label_names,
                                                  std::vector<double> upper_bounds);

  // The whole registry in the Prometheus text format (prometheus::TextSerializer), families in
  // name order and series in label order. Families without a series are left out.
  std::string Serialize() const;

 private:
  absl::Status CheckNew(const std::string& name, const std::vector<std::string>& label_names,
                        bool histogram) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<prometheus::Registry> impl_;
  mutable absl::Mutex mu_;
  std::set<std::string> names_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Counter>>> counters_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Gauge>>> gauges_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Histogram>>> histograms_ ABSL_GUARDED_BY(mu_);
};

// Registers pdserve_build_info{role, version} = 1 (docs/metrics.md, "Every process"): `role` is
// router, prefill, decode or serve; the version is pdserve::kVersion (common/version.h).
// Errors: those of Registry::AddGauge (a second call on the same registry: InvalidArgument).
absl::Status AddBuildInfo(Registry& registry, const std::string& role);

}  // namespace pdserve::metrics
