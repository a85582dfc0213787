#include "kvtransfer/transfer_metrics.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/histogram_buckets.h"
#include "common/status.h"

namespace pdserve::kv {

absl::string_view SendFailureCause(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
      return "endpoint_closed";
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout";
    case absl::StatusCode::kCancelled:
      return "rejected";
    default:
      return "send_error";
  }
}

absl::StatusOr<std::unique_ptr<TransferMetrics>> TransferMetrics::Create(
    metrics::Registry& registry, std::string side) {
  std::unique_ptr<TransferMetrics> m(new TransferMetrics());
  m->side_ = std::move(side);
  const std::vector<std::string> labels = {"side", "path", "lanes"};
  // 4 KiB .. 64 GiB, x4: one page to a long prompt's whole state.
  PDSERVE_ASSIGN_OR_RETURN(
      m->bytes_, registry.AddHistogram("pdserve_kv_transfer_bytes",
                                       "State-page bytes of one request's transfer", labels,
                                       metrics::GeometricBuckets(4096, 4, 68719476736.0)));
  // 100 us .. ~582 s, x2.5.
  PDSERVE_ASSIGN_OR_RETURN(
      m->seconds_,
      registry.AddHistogram("pdserve_kv_transfer_seconds",
                            "One request's transfer: send: first post -> commit delivered; "
                            "receive: first page accepted -> verified",
                            labels, metrics::GeometricBuckets(1e-4, 2.5, 650)));
  // 1e6 .. ~1.3e11 B/s (1 MB/s .. 131 GB/s), x2.
  PDSERVE_ASSIGN_OR_RETURN(
      m->bandwidth_,
      registry.AddHistogram("pdserve_kv_transfer_bandwidth_bytes_per_second",
                            "Per request bytes / transfer seconds (GB/s = value / 1e9)", labels,
                            metrics::GeometricBuckets(1e6, 2, 1.5e11)));
  PDSERVE_ASSIGN_OR_RETURN(m->failures_,
                           registry.AddCounter("pdserve_kv_transfer_failures_total",
                                               "Failed transfers by cause", {"side", "cause"}));
  std::vector<std::string> causes;
  if (m->side_ == "send") {
    causes.assign(std::begin(kSendCauses), std::end(kSendCauses));
  } else {
    causes.assign(std::begin(kReceiveCauses), std::end(kReceiveCauses));
  }
  m->failures_->ExportAtZero({{m->side_}, causes});
  return m;
}

void TransferMetrics::RecordTransfer(absl::string_view path, int lanes, uint64_t bytes,
                                     absl::Duration elapsed) {
  const std::vector<std::string> labels = {side_, std::string(path), absl::StrCat(lanes)};
  const double seconds = absl::ToDoubleSeconds(elapsed);
  bytes_->WithLabels(labels).Observe(static_cast<double>(bytes));
  seconds_->WithLabels(labels).Observe(seconds);
  if (seconds > 0) {
    bandwidth_->WithLabels(labels).Observe(static_cast<double>(bytes) / seconds);
  }
}

void TransferMetrics::RecordFailure(absl::string_view cause) {
  failures_->WithLabels({side_, std::string(cause)}).Increment();
}

}  // namespace pdserve::kv
