// The decode worker's side of the early import (runtime/early_import.h): a request's GPU slot is
// claimed at Reserve, each layer is imported as the receiver reports its pages landed and
// checked (OnLayer), and a verified request joins the batch only once every layer's copy
// landed (DeferJoin, RunEarlyImports). A request that ends any other way (failed checksum, lost
// lane, abandoned, aborted, lease) has its import cancelled and its slot freed, through Apply's
// QueueImportCancel and the transfer loop; it never joined the batch, so no step read the slot.
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "decode/decode_worker.h"
#include "spdlog/spdlog.h"

namespace pdserve::decode {

void DecodeWorker::BeginEarlyImport(Request& record, int32_t choice_count) {
  // A shared reservation's forks start from copies of the verified pages: they import at their
  // first step, as does fork 0 with them.
  if (early_importer_ == nullptr || choice_count > 1) return;
  const auto prompt = static_cast<int64_t>(record.prompt.size());
  // The import holds the pages while it may read them: a request that ends meanwhile (released
  // ticket, abort) gives up only its own hold (Apply), never the pages under the import's read.
  std::shared_ptr<const serving::PageLease> pages;
  {
    absl::MutexLock lock(&mu_);
    pages = record.pages;
  }
  if (pages == nullptr) return;
  const absl::Status begun =
      early_importer_->Begin(record.sequence, prompt, prompt + record.params.max_tokens, pages);
  if (!begun.ok()) {
    // No free slot is expected under load (the default path then): not worth a warning each time.
    if (absl::IsResourceExhausted(begun)) {
      spdlog::debug("request {}: no early import ({}); its state is imported at its first step",
                    record.request_id, begun.ToString());
    } else {
      spdlog::warn("request {}: no early import ({}); its state is imported at its first step",
                   record.request_id, begun.ToString());
    }
    return;
  }
  absl::MutexLock lock(&mu_);
  record.early_import = true;
  // Aborted meanwhile (before its ticket exists): Register refuses it and Apply cancels this.
}

void DecodeWorker::OnLayer(uint64_t request_id, uint32_t layer) {
  if (early_importer_ == nullptr) return;
  serving::RequestId sequence = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second->early_import) return;
    sequence = it->second->sequence;
  }
  early_importer_->LayerArrived(sequence, layer);
}

bool DecodeWorker::DeferJoin(const std::shared_ptr<Request>& record, int32_t first_token) {
  if (!record->early_import) return false;
  early_importer_->Verified(record->sequence);
  deferred_joins_.push_back({record, first_token});
  return true;
}

void DecodeWorker::QueueImportCancel(Request& request) {
  if (!request.early_import) return;
  request.early_import = false;
  import_cancels_.push_back(request.sequence);
}

void DecodeWorker::RunEarlyImports() {
  std::vector<serving::RequestId> cancels;
  std::vector<DeferredJoin> joins;
  {
    absl::MutexLock lock(&mu_);
    cancels.swap(import_cancels_);
    joins.swap(deferred_joins_);
  }
  // Each may wait for the step in flight (the slot's pages go back on the model).
  for (serving::RequestId sequence : cancels) early_importer_->Cancel(sequence);
  std::vector<DeferredJoin> waiting;
  for (DeferredJoin& join : joins) {
    Request& r = *join.record;
    const absl::StatusOr<bool> ready = early_importer_->Ready(r.sequence);
    absl::MutexLock lock(&mu_);
    if (r.state != RequestState::kReceiving) {
      // Aborted (or drained) while its copies landed: the verified pages are ours, nothing
      // decodes them; Apply queues the import's cancel.
      if (r.state == RequestState::kAbortedReceiving) Apply(r, RequestEvent::kEndAtStart);
      MaybeForget(r.request_id);
      continue;
    }
    if (!ready.ok()) {
      // The import failed: its slot is already free. Only this request fails, loudly.
      spdlog::error("request {}: early import failed: {}", r.request_id, ready.status().ToString());
      r.early_import = false;
      Finish(r, RequestEvent::kEndAtStart, "error", ready.status());
      MaybeForget(r.request_id);
      continue;
    }
    if (!*ready) {
      waiting.push_back(std::move(join));
      continue;
    }
    if (absl::Status taken = early_importer_->Take(r.sequence); !taken.ok()) {
      spdlog::error("request {}: {}", r.request_id, taken.ToString());
      Finish(r, RequestEvent::kEndAtStart, "error", taken);  // its import is cancelled
      MaybeForget(r.request_id);
      continue;
    }
    // The runner owns the slot from here: Add starts the sequence in it (or gives it back). Its
    // copies have landed and the transfer verified: the device pages are read no more.
    r.early_import = false;
    r.device_pages.reset();
    JoinBatch(r, join.first_token);
  }
  absl::MutexLock lock(&mu_);
  for (DeferredJoin& join : waiting) deferred_joins_.push_back(std::move(join));
}

}  // namespace pdserve::decode
