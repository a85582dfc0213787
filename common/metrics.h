// A small Prometheus metrics registry: counters, gauges and histograms with labels, rendered in
// the Prometheus text exposition format 0.0.4 (what /metrics serves).
//
// Debian 12 packages no Prometheus C++ client, so pdserve keeps this one; its output is checked
// with `promtool check metrics` in the tests. Metric names are pdserve_* by convention.
//
// Thread-safety: every method is safe to call from any thread. Families and series are created
// under a mutex and never destroyed while the registry lives, so references returned by
// Family::WithLabels() stay valid for the registry's lifetime; updating a series is lock-free
// (atomics). Serialize() takes a consistent-enough snapshot: each value is read atomically, a
// histogram's buckets, sum and count may come from slightly different instants.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::metrics {

class Counter {
 public:
  // REQUIRES: delta >= 0 (a negative delta is ignored: counters only go up).
  void Increment(double delta = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double delta);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `upper_bounds` strictly increasing and finite; the +Inf bucket is implicit.
  explicit Histogram(std::vector<double> upper_bounds);
  // Records one observation (seconds for latencies). NaN is ignored.
  void Observe(double v);
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  // Non-cumulative count of bucket i (i == upper_bounds().size() is the +Inf bucket).
  uint64_t BucketCount(size_t i) const { return counts_[i].load(std::memory_order_relaxed); }
  uint64_t Count() const { return count_.load(std::memory_order_relaxed); }
  double Sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> upper_bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

// Latency buckets from 1 ms to 600 s (seconds), roughly x2.5 apart: the router's TTFT, ITL, TPOT,
// end-to-end and queue-time histograms use them.
std::vector<double> LatencyBucketsSeconds();

enum class MetricType { kCounter, kGauge, kHistogram };

// All series of one metric name, one per distinct label-value tuple.
template <typename T>
class Family {
 public:
  // The series for `label_values` (same order as the family's label names), created on first
  // use. REQUIRES: label_values.size() == number of label names (else the call aborts: a
  // programming error, not an input error).
  T& WithLabels(const std::vector<std::string>& label_values);
  // The series with no labels. REQUIRES: the family has no label names.
  T& Get() { return WithLabels({}); }
  // (label values, series) pairs in label-value order; the pointers stay valid for the
  // registry's lifetime.
  std::vector<std::pair<std::vector<std::string>, const T*>> Series() const {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<std::vector<std::string>, const T*>> out;
    for (const auto& [labels, series] : series_) out.emplace_back(labels, series.get());
    return out;
  }

 private:
  friend class Registry;
  Family(std::vector<std::string> label_names, std::vector<double> buckets)
      : label_names_(std::move(label_names)), buckets_(std::move(buckets)) {}

  const std::vector<std::string> label_names_;
  const std::vector<double> buckets_;  // histograms only
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> series_ ABSL_GUARDED_BY(mu_);
};

template <typename T>
T& Family<T>::WithLabels(const std::vector<std::string>& label_values) {
  if (label_values.size() != label_names_.size()) std::abort();
  absl::MutexLock lock(&mu_);
  auto& slot = series_[label_values];
  if (!slot) {
    if constexpr (std::is_same_v<T, Histogram>) {
      slot = std::make_unique<Histogram>(buckets_);
    } else {
      slot = std::make_unique<T>();
    }
  }
  return *slot;
}

class Registry {
 public:
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

  // The whole registry in the Prometheus text format, families in name order.
  std::string Serialize() const;

 private:
  struct Entry {
    MetricType type;
    std::string help;
    std::vector<std::string> label_names;
    std::unique_ptr<Family<Counter>> counter;
    std::unique_ptr<Family<Gauge>> gauge;
    std::unique_ptr<Family<Histogram>> histogram;
  };
  absl::Status CheckNew(const std::string& name, const std::vector<std::string>& label_names,
                        bool histogram) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Registers pdserve_build_info{role, version} = 1 (docs/metrics.md, "Every process"): `role` is
// router, prefill, decode or serve; the version is pdserve::kVersion (common/version.h).
// Errors: those of Registry::AddGauge (a second call on the same registry: InvalidArgument).
absl::Status AddBuildInfo(Registry& registry, const std::string& role);

}  // namespace pdserve::metrics
