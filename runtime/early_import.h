// The CUDA decode side's early import (issue 27): a transferred prompt's state goes into its
// decode slot layer by layer WHILE later layers are still arriving, instead of all at once after
// the transfer verified.
//
// Life of one request's import (EarlyImportState, changed only by NextEarlyImportState):
//
//   Begin: the slot and its state pages are claimed (SlotImporter::Claim)    -> kImporting
//   each layer whose pages all landed with good checksums (kv::ReceiverOptions::on_layer) is
//   queued; the importer's own thread imports it (SlotImporter::ImportLayer: the host fill and
//   the enqueue of its copies), in arrival order, each layer once
//   kImporting --kAllCopied--> kCopied        (every layer's copy landed; NOT verified)
//   kImporting --kVerified-->  kVerified      (the commit verified; copies still pending)
//   kCopied --kVerified--> kReady;  kVerified --kAllCopied--> kReady      (runnable)
//   kReady --kTaken--> kTaken                (the step runner owns the slot from here)
//   kImporting / kCopied / kVerified --kImportFailed--> kFailed  (slot released; the request
//                                                                  fails with the error)
//   any but kTaken --kCancel--> kCancelled   (failed checksum, lost lane, abort, lease: slot
//                                              released once no import call for it runs)
//   an event outside this table is a bug: logged, and the import fails as on kImportFailed
//   (slot released, now or when the import call for it returns)
//
// The slot is never readable by a step before kReady: GpuModel's staged import keeps its
// position 0 until the runner finishes it, and the runner takes only kReady slots, so pdserve
// never decodes from unverified state.
//
// Pages. The import reads the sequence's state pages (ImportLayer's fill) on its own thread, so
// it holds them (Begin's serving::PageLease) from Begin until no import call for it can run any
// more: a request that ends meanwhile gives up its own hold, and the pages go back to the pool
// when the import lets go of them too, never under a read.
//
// Thread-safety: every public method may be called from any thread (one mutex; LayerArrived is
// cheap and may run under the receiver's mutex). SlotImporter calls for one request never
// overlap; ImportLayer / Copied run on the importer's thread, Claim on Begin's caller's,
// Release on whichever thread ends the import (Cancel's caller, the importer's thread, or the
// caller whose event was illegal). The last holder of Begin's pages frees them on its thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "serving/page_lease.h"
#include "serving/page_pool.h"

namespace pdserve::runtime {

enum class EarlyImportState {
  kImporting,  // slot claimed; layers import as they arrive; transfer not verified
  kCopied,     // every layer's copy landed; transfer not verified
  kVerified,   // transfer verified; some layers' copies still pending
  kReady,      // verified and every copy landed: the runner may take the slot
  kTaken,      // handed to the runner
  kFailed,     // an import call failed: slot released, the request fails with the error
  kCancelled,  // ended before kTaken (transfer failed, aborted, lease): slot released
};

enum class EarlyImportEvent { kAllCopied, kVerified, kTaken, kImportFailed, kCancel };

// The state `event` leads to from `state`. FailedPrecondition naming both for an event that
// cannot happen there (a bug in the caller). kCancel on kFailed / kCancelled stays there.
absl::StatusOr<EarlyImportState> NextEarlyImportState(EarlyImportState state,
                                                      EarlyImportEvent event);
const char* EarlyImportStateName(EarlyImportState state);

// A sequence's transferred pages in device memory (the CUDA IPC path: the decode worker's device
// page pool; docs/protocol.md, "Same-host device-to-device pages (CUDA IPC)"): pages[k][i] is
// PageTable::pages[k][i]'s payload in the model's device memory, laid out as the host pages.
// `hold` keeps them allocated; the slot importer drops it once no copy of its can read them.
struct DevicePageSource {
  std::vector<std::vector<std::byte*>> pages;
  std::shared_ptr<const void> hold;
};

// A slot that takes a prompt's state layer by layer (runtime/cuda/gpu_slot_importer.h over
// GpuModel's staged import; a fake in the host tests).
class SlotImporter {
 public:
  virtual ~SlotImporter() = default;
  // Claims a slot for sequence `id` (whose state pages, for `total_tokens`, hold the transfer)
  // and its device state pages for `position` prompt tokens; the slot stays unreadable.
  // ResourceExhausted when no slot or page is free; AlreadyExists for a claimed id.
  virtual absl::Status Claim(serving::RequestId id, int64_t position, int64_t total_tokens) = 0;
  // Claim, with the state read from `source` instead of the sequence's host pages: each layer
  // then imports device to device. Unimplemented where the importer has no device path.
  virtual absl::Status ClaimFromDevice(serving::RequestId /*id*/, int64_t /*position*/,
                                       int64_t /*total_tokens*/, DevicePageSource /*source*/) {
    return absl::UnimplementedError("this slot importer reads host pages only");
  }
  // Fills layer `layer` from the sequence's pages and enqueues its copies (may block for the
  // fill, host work). Each layer once.
  virtual absl::Status ImportLayer(serving::RequestId id, int64_t layer) = 0;
  // ImportLayer of each of `layers` (distinct, each once over the import), in order; an
  // importer may enqueue them together (the device path: one launch pair for all). The first
  // error is returned and the import is then failed by the caller (a layer of the call may have
  // been marked enqueued without its copies). This default calls ImportLayer one by one.
  virtual absl::Status ImportLayers(serving::RequestId id, std::span<const int64_t> layers) {
    for (int64_t layer : layers) {
      if (absl::Status imported = ImportLayer(id, layer); !imported.ok()) return imported;
    }
    return absl::OkStatus();
  }
  // Whether every layer was imported and its copies have landed; never blocks for the copies.
  virtual absl::StatusOr<bool> Copied(serving::RequestId id) = 0;
  // Gives the slot and its pages back (waits for copies in flight). Unknown ids are ignored.
  virtual void Release(serving::RequestId id) = 0;
};

class EarlyImporter {
 public:
  // `slots` must outlive the importer; `layers`: the model's layer count. Starts its thread.
  // `batch_layers`: the layers of a device import (BeginFromDevice) queued when the thread takes
  // the next go to the slot importer in one ImportLayers call (a transfer's layers that arrive
  // together are enqueued together: one launch pair); false, and for host imports (whose fills
  // are host work a layer, and whose cancel stops before the next layer): one call a layer.
  // Default: BatchEarlyImportLayers().
  EarlyImporter(SlotImporter* slots, int64_t layers);
  EarlyImporter(SlotImporter* slots, int64_t layers, bool batch_layers);
  // Stops the thread and releases every slot not taken.
  ~EarlyImporter();
  EarlyImporter(const EarlyImporter&) = delete;
  EarlyImporter& operator=(const EarlyImporter&) = delete;

  // Claims the slot of sequence `id` for a prompt of `position` tokens (SlotImporter::Claim's
  // errors; AlreadyExists for an id begun and not forgotten). `pages`: a hold on the sequence's
  // pages, kept until no import call for it can read them any more (the import is taken,
  // failed or cancelled and its call returned); null when the caller keeps the pages for the
  // importer's whole life.
  absl::Status Begin(serving::RequestId id, int64_t position, int64_t total_tokens,
                     std::shared_ptr<const serving::PageLease> pages = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Begin with the state in device pages (SlotImporter::ClaimFromDevice's errors).
  absl::Status BeginFromDevice(serving::RequestId id, int64_t position, int64_t total_tokens,
                               DevicePageSource source,
                               std::shared_ptr<const serving::PageLease> pages = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Layer `layer`'s pages all landed and passed their checksums: queued for the thread. Ignored
  // for an unknown or ended id, a layer already queued, or one outside [0, layers).
  void LayerArrived(serving::RequestId id, int64_t layer) ABSL_LOCKS_EXCLUDED(mu_);
  // The transfer verified. Ignored for an unknown or ended id.
  void Verified(serving::RequestId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the import (the transfer failed, the request was aborted, its lease passed): the slot
  // is released now, or, when an import call for it is running, right after that call; the id
  // is forgotten. Unknown ids are ignored.
  void Cancel(serving::RequestId id) ABSL_LOCKS_EXCLUDED(mu_);
  // true once kReady; false while importing; the error of kFailed (the id is then forgotten);
  // NotFound for an unknown (or cancelled) id.
  absl::StatusOr<bool> Ready(serving::RequestId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Hands a kReady import to the runner (the slot stays claimed; the id is forgotten here).
  // FailedPrecondition in any other state, NotFound for an unknown id.
  absl::Status Take(serving::RequestId id) ABSL_LOCKS_EXCLUDED(mu_);
  // The import's state (tests, stats); nullopt for an unknown id.
  std::optional<EarlyImportState> StateOf(serving::RequestId id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Imports begun and not yet forgotten.
  int64_t active() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Record {
    EarlyImportState state = EarlyImportState::kImporting;
    absl::Status error;
    std::vector<char> queued;  // per layer
    int64_t imported = 0;      // layers whose ImportLayer succeeded
    bool busy = false;         // an ImportLayer / Copied call for it runs (mu_ not held)
    // An illegal event while a call ran (a bug): the call's return fails the import with it.
    absl::Status fault;
    std::shared_ptr<const serving::PageLease> pages;  // Begin's, dropped once no call can read
    bool device = false;  // BeginFromDevice's: its queued layers go in one ImportLayers call
  };
  friend class EarlyImporterTestPeer;  // tests: events outside the lifecycle
  // Begin's work around `claim` (the slot importer's claim of `id`).
  absl::Status BeginWith(serving::RequestId id, std::shared_ptr<const serving::PageLease> pages,
                         bool device, const std::function<absl::Status()>& claim)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Run();
  // Applies `event`. An illegal one is a bug: logged, and the import fails (its slot released
  // now, or by the call running for it when that returns). May drop mu_ (the release); the
  // caller must not use `record` afterwards.
  void Apply(serving::RequestId id, Record& record, EarlyImportEvent event)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One import call for the front of the queue, or the copy checks; false when idle.
  bool Work() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The import of `id` (marked busy by the caller, its slot held) fails with `error`: gives its
  // slot and pages back, then publishes kFailed (or forgets it, when it was cancelled meanwhile).
  void Fail(serving::RequestId id, absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An import call for `id` returned: releases a record cancelled meanwhile.
  void AfterCall(serving::RequestId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The record's slot is released (mu_ dropped around the call).
  void ReleaseSlot(serving::RequestId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SlotImporter* const slots_;
  const int64_t layers_;
  const bool batch_layers_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<serving::RequestId, Record> records_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<serving::RequestId, int64_t>> queue_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Whether EarlyImporter batches a request's queued layers by default: true unless the
// environment's PDSERVE_EARLY_IMPORT_BATCH is 0 (the A/B switch: one layer a call, as before;
// 1 or unset: batched; another value is warned about and ignored, kernels/env_switch.h).
bool BatchEarlyImportLayers();

// Serializes a model's staged-import calls with its step loop, short import sections first: an
// importer waits at most for the step in flight, and the step loop lets a waiting importer in
// before its next step (an import section only enqueues copies: microseconds).
class ModelLock {
 public:
  void LockForImport() ABSL_NO_THREAD_SAFETY_ANALYSIS;
  void LockForStep() ABSL_NO_THREAD_SAFETY_ANALYSIS;
  void Unlock() ABSL_NO_THREAD_SAFETY_ANALYSIS;

 private:
  absl::Mutex mu_;
  std::atomic<int> importers_waiting_{0};
};

}  // namespace pdserve::runtime
