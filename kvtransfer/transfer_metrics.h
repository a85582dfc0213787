// Per-request transfer metrics, recorded by the transfer core on both sides (docs/metrics.md,
// "State transfer"): bytes, seconds and bandwidth of every completed transfer by side, path and
// lane count, and failures by side and cause.
//
//   pdserve_kv_transfer_bytes{side, path, lanes}                        histogram, bytes
//   pdserve_kv_transfer_seconds{side, path, lanes}                      histogram, seconds
//   pdserve_kv_transfer_bandwidth_bytes_per_second{side, path, lanes}   histogram, bytes / s
//   pdserve_kv_transfer_failures_total{side, cause}                     counter
//
// side: "send" (the prefill worker: first post -> commit delivered) or "receive" (the decode
// worker: first page accepted -> verified). path: where the pages live and how they move
// ("host": host memory over UCX; "host-staged": a CUDA engine's pages copied to host memory, then
// UCX; "cuda": device memory over UCX; "loopback": the in-process transport). lanes: the
// transport's lane count. The causes are kSendCauses / kReceiveCauses, each exported at 0.
//
// Thread-safety: every method is thread-safe (prometheus-cpp series are atomic).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace pdserve::kv {

// Sender causes: connect (Prepare could not connect), timeout (the ticket's lease passed),
// endpoint_closed (the decode worker was lost: UCX's peer error or a disconnect), rejected (a
// send completed Cancelled: the receiver refused a page of a ticket it no longer receives),
// send_error (any other send error), abort (the transfer was destroyed before its commit was
// delivered: the prefill was aborted or failed, and the transfer fenced).
inline constexpr const char* kSendCauses[] = {"connect",  "timeout",    "endpoint_closed",
                                              "rejected", "send_error", "abort"};
// Receiver causes: the isolation errors (checksum, header, epoch, duplicate, missing; lease is
// "timeout"), abort (Abort(): the router cancelled) and abandoned (the sender fenced before
// committing).
inline constexpr const char* kReceiveCauses[] = {"checksum", "header",  "epoch", "duplicate",
                                                 "missing",  "timeout", "abort", "abandoned"};

// The send-side cause of a transfer's first error (see kSendCauses; abort is not a status).
absl::string_view SendFailureCause(const absl::Status& status);

class TransferMetrics {
 public:
  // Registers the four families on `registry` (which must outlive this) for `side` ("send" or
  // "receive") and exports its causes at 0. Errors: the registry's InvalidArgument when a family
  // of the same name exists there already (one TransferMetrics per registry).
  static absl::StatusOr<std::unique_ptr<TransferMetrics>> Create(metrics::Registry& registry,
                                                                 std::string side);

  // One transfer of `bytes` that took `elapsed`; bandwidth is observed only when elapsed > 0.
  void RecordTransfer(absl::string_view path, int lanes, uint64_t bytes, absl::Duration elapsed);
  // One failed transfer (each once).
  void RecordFailure(absl::string_view cause);

 private:
  TransferMetrics() = default;
  std::string side_;
  metrics::Family<metrics::Histogram>* bytes_ = nullptr;
  metrics::Family<metrics::Histogram>* seconds_ = nullptr;
  metrics::Family<metrics::Histogram>* bandwidth_ = nullptr;
  metrics::Family<metrics::Counter>* failures_ = nullptr;
};

}  // namespace pdserve::kv
