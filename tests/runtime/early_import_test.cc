// runtime::EarlyImporter's state machine over a fake SlotImporter (no GPU): layers imported in
// the order they arrive, each once; runnable only when verified AND every copy landed; a failed
// layer import, a cancel (failed checksum, lost lane, abort, lease) or the importer's end gives
// the slot and its pages back (the fake's admission counts) and fails or forgets only that
// request. The GPU side (GpuModel's staged import) is tests/engine_gpu/gpu_early_import_test.cc.
#include "runtime/early_import.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "serving/page_lease.h"
#include "serving/page_pool.h"
#include "tests/common/switch_warnings.h"

namespace pdserve::runtime {
namespace {

constexpr int64_t kLayers = 4;

// Slots with admission counts: `free_slots` slots, each claim holding position / 64 + 1 pages of
// `free_pages`. Every call is recorded.
class FakeSlots : public SlotImporter {
 public:
  absl::Status Claim(serving::RequestId id, int64_t position, int64_t) override {
    absl::MutexLock lock(&mu_);
    if (claimed_.contains(id)) return absl::AlreadyExistsError("claimed");
    const int64_t pages = position / 64 + 1;
    if (free_slots_ == 0 || free_pages_ < pages) return absl::ResourceExhaustedError("full");
    --free_slots_;
    free_pages_ -= pages;
    claimed_[id] = {pages, 0};
    return absl::OkStatus();
  }
  absl::Status ImportLayer(serving::RequestId id, int64_t layer) override {
    if (layer == block_layer_) {
      entered_.Notify();
      blocked_.WaitForNotification();
    }
    absl::MutexLock lock(&mu_);
    imported_.push_back(layer);
    if (layer == fail_layer_) return absl::DataLossError("injected fill failure");
    ++claimed_.at(id).second;
    return absl::OkStatus();
  }
  absl::Status ClaimFromDevice(serving::RequestId id, int64_t position, int64_t total_tokens,
                               DevicePageSource) override {
    return Claim(id, position, total_tokens);
  }
  absl::Status ImportLayers(serving::RequestId id, std::span<const int64_t> layers) override {
    {
      absl::MutexLock lock(&mu_);
      calls_.emplace_back(layers.begin(), layers.end());
    }
    return SlotImporter::ImportLayers(id, layers);
  }
  absl::StatusOr<bool> Copied(serving::RequestId id) override {
    absl::MutexLock lock(&mu_);
    if (!copy_error_.ok()) return copy_error_;
    return copies_land_ && claimed_.at(id).second == kLayers;
  }
  void Release(serving::RequestId id) override {
    if (block_release_) {
      release_entered_.Notify();
      release_blocked_.WaitForNotification();
    }
    absl::MutexLock lock(&mu_);
    auto it = claimed_.find(id);
    if (it == claimed_.end()) return;
    ++free_slots_;
    free_pages_ += it->second.first;
    ++releases_;
    claimed_.erase(it);
  }

  int64_t free_slots() {
    absl::MutexLock lock(&mu_);
    return free_slots_;
  }
  int64_t free_pages() {
    absl::MutexLock lock(&mu_);
    return free_pages_;
  }
  int64_t releases() {
    absl::MutexLock lock(&mu_);
    return releases_;
  }
  std::vector<int64_t> imported() {
    absl::MutexLock lock(&mu_);
    return imported_;
  }
  // The layers of each ImportLayers call, in order.
  std::vector<std::vector<int64_t>> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  void set_copies_land(bool land) {
    absl::MutexLock lock(&mu_);
    copies_land_ = land;
  }

  int64_t fail_layer_ = -1;
  int64_t block_layer_ = -1;
  absl::Notification entered_;  // block_layer_'s import started
  absl::Notification blocked_;  // lets it go on
  absl::Status copy_error_;     // what Copied returns instead of its answer, when not OK
  bool block_release_ = false;  // Release waits for release_blocked_
  absl::Notification release_entered_;
  absl::Notification release_blocked_;

 private:
  absl::Mutex mu_;
  int64_t free_slots_ = 2;
  int64_t free_pages_ = 10;
  int64_t releases_ = 0;
  bool copies_land_ = true;
  std::map<serving::RequestId, std::pair<int64_t, int64_t>> claimed_;  // pages, layers imported
  std::vector<int64_t> imported_;
  std::vector<std::vector<int64_t>> calls_;
};

// Waits (at most 10 s: a hang is a failure, not a timing) until `done` holds.
template <typename F>
bool Eventually(F done) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Microseconds(100));
  }
  return true;
}

TEST(EarlyImportTest, OutOfOrderLayersImportOnceEachAndRunOnlyOnceVerified) {
  FakeSlots slots;
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(7, 100, 200).ok());
  EXPECT_EQ(slots.free_slots(), 1);
  for (int64_t layer : {2, 0, 3, 0, 1, 2, 9, -1}) importer.LayerArrived(7, layer);
  ASSERT_TRUE(Eventually([&] { return importer.StateOf(7) == EarlyImportState::kCopied; }));
  EXPECT_EQ(slots.imported(), (std::vector<int64_t>{2, 0, 3, 1}));
  // Every layer is in the slot, but the transfer is not verified: not runnable.
  absl::StatusOr<bool> ready = importer.Ready(7);
  ASSERT_TRUE(ready.ok());
  EXPECT_FALSE(*ready);
  EXPECT_TRUE(absl::IsFailedPrecondition(importer.Take(7)));
  importer.Verified(7);
  ready = importer.Ready(7);
  ASSERT_TRUE(ready.ok());
  EXPECT_TRUE(*ready);
  ASSERT_TRUE(importer.Take(7).ok());
  // The runner owns the slot now: nothing was released.
  EXPECT_EQ(importer.active(), 0);
  EXPECT_EQ(slots.releases(), 0);
  EXPECT_EQ(slots.free_slots(), 1);
}

// A device import's layers that queue while an import call runs go to the slot importer together
// in the next call, in arrival order (one launch pair on the GPU); a host import's (request 8)
// stay one a call; with batching off, one call a layer for every import.
TEST(EarlyImportTest, DeviceLayersQueuedDuringACallGoInOneCall) {
  for (bool batch : {true, false}) {
    SCOPED_TRACE(batch ? "batched" : "one a call");
    FakeSlots slots;
    slots.block_layer_ = 0;
    EarlyImporter importer(&slots, kLayers, batch);
    ASSERT_TRUE(importer.BeginFromDevice(7, 100, 200, {}).ok());
    ASSERT_TRUE(importer.Begin(8, 10, 20).ok());
    importer.LayerArrived(7, 0);
    slots.entered_.WaitForNotification();  // layer 0's call runs
    importer.LayerArrived(7, 3);
    importer.LayerArrived(8, 1);
    importer.LayerArrived(7, 1);
    importer.LayerArrived(8, 2);
    importer.LayerArrived(7, 2);
    slots.blocked_.Notify();
    importer.Verified(7);
    ASSERT_TRUE(Eventually([&] { return importer.Ready(7).value_or(false); }));
    ASSERT_TRUE(Eventually([&] { return slots.calls().size() == (batch ? 4u : 6u); }));
    using Calls = std::vector<std::vector<int64_t>>;
    const Calls calls =
        batch ? Calls{{0}, {3, 1, 2}, {1}, {2}} : Calls{{0}, {3}, {1}, {1}, {2}, {2}};
    EXPECT_EQ(slots.calls(), calls);
    const std::vector<int64_t> imported =
        batch ? std::vector<int64_t>{0, 3, 1, 2, 1, 2} : std::vector<int64_t>{0, 3, 1, 1, 2, 2};
    EXPECT_EQ(slots.imported(), imported);
  }
}

TEST(EarlyImportTest, VerifiedBeforeTheCopiesLandIsNotRunnableUntilTheyDo) {
  FakeSlots slots;
  slots.set_copies_land(false);
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(3, 64, 128).ok());
  for (int64_t layer = 0; layer < kLayers; ++layer) importer.LayerArrived(3, layer);
  importer.Verified(3);
  ASSERT_TRUE(Eventually([&] { return slots.imported().size() == kLayers; }));
  EXPECT_EQ(importer.StateOf(3), EarlyImportState::kVerified);
  absl::StatusOr<bool> ready = importer.Ready(3);
  ASSERT_TRUE(ready.ok());
  EXPECT_FALSE(*ready);
  slots.set_copies_land(true);
  ASSERT_TRUE(Eventually([&] { return importer.StateOf(3) == EarlyImportState::kReady; }));
}

TEST(EarlyImportTest, AFailedLayerFreesTheSlotAndFailsOnlyThatRequest) {
  FakeSlots slots;
  slots.fail_layer_ = 1;
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(1, 300, 400).ok());
  ASSERT_TRUE(importer.Begin(2, 0, 10).ok());
  EXPECT_EQ(slots.free_pages(), 10 - 5 - 1);
  importer.LayerArrived(1, 0);
  importer.LayerArrived(1, 1);
  ASSERT_TRUE(Eventually([&] { return importer.StateOf(1) == EarlyImportState::kFailed; }));
  // The slot and its pages are back at once; later layers of it are not imported.
  EXPECT_EQ(slots.free_slots(), 1);
  EXPECT_EQ(slots.free_pages(), 10 - 1);
  importer.LayerArrived(1, 2);
  importer.Verified(1);
  const absl::StatusOr<bool> ready = importer.Ready(1);
  EXPECT_TRUE(absl::IsDataLoss(ready.status())) << ready.status();
  EXPECT_EQ(importer.StateOf(1), std::nullopt);  // read once, forgotten
  // The other request is untouched and still imports (layer 1 fails for every request here, so
  // it only takes layer 0).
  importer.LayerArrived(2, 0);
  ASSERT_TRUE(Eventually([&] { return slots.imported().size() == 3; }));
  EXPECT_EQ(importer.StateOf(2), EarlyImportState::kImporting);
  EXPECT_EQ(slots.imported(), (std::vector<int64_t>{0, 1, 0}));
}

TEST(EarlyImportTest, CancelDuringALayerImportReleasesTheSlotWhenTheCallReturns) {
  FakeSlots slots;
  slots.block_layer_ = 0;
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(5, 128, 256).ok());
  importer.LayerArrived(5, 0);
  importer.LayerArrived(5, 1);
  // Layer 0's import is running (blocked): the slot cannot be freed under it.
  slots.entered_.WaitForNotification();
  importer.Cancel(5);
  EXPECT_EQ(importer.StateOf(5), EarlyImportState::kCancelled);
  EXPECT_EQ(slots.releases(), 0);
  slots.blocked_.Notify();
  ASSERT_TRUE(Eventually([&] { return slots.releases() == 1; }));
  EXPECT_EQ(slots.free_slots(), 2);
  EXPECT_EQ(slots.free_pages(), 10);
  EXPECT_EQ(importer.StateOf(5), std::nullopt);
  EXPECT_TRUE(absl::IsNotFound(importer.Ready(5).status()));
  // Layer 1 was queued before the cancel and is never imported.
  EXPECT_EQ(slots.imported(), std::vector<int64_t>{0});
}

TEST(EarlyImportTest, CancelledAndUnusedSlotsAreFreeForTheNextRequest) {
  FakeSlots slots;
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(1, 10, 20).ok());
  ASSERT_TRUE(importer.Begin(2, 10, 20).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(importer.Begin(3, 10, 20)));
  EXPECT_TRUE(absl::IsAlreadyExists(importer.Begin(1, 10, 20)));
  importer.Cancel(1);  // before any layer: released at once
  EXPECT_EQ(slots.releases(), 1);
  EXPECT_TRUE(importer.Begin(3, 10, 20).ok());
  importer.Cancel(1);  // unknown now: ignored
  EXPECT_EQ(slots.releases(), 1);
}

TEST(EarlyImportTest, AFailedCopyCheckFreesTheSlotAndFailsOnlyThatRequest) {
  FakeSlots slots;
  slots.copy_error_ = absl::InternalError("injected event query failure");
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(4, 64, 128).ok());
  for (int64_t layer = 0; layer < kLayers; ++layer) importer.LayerArrived(4, layer);
  ASSERT_TRUE(Eventually([&] { return importer.StateOf(4) == EarlyImportState::kFailed; }));
  EXPECT_EQ(slots.releases(), 1);
  EXPECT_EQ(slots.free_slots(), 2);
  EXPECT_EQ(slots.free_pages(), 10);
  importer.Verified(4);  // the transfer verifying afterwards does not make it runnable
  const absl::StatusOr<bool> ready = importer.Ready(4);
  EXPECT_TRUE(absl::IsInternal(ready.status())) << ready.status();
  EXPECT_EQ(importer.StateOf(4), std::nullopt);
  EXPECT_EQ(slots.releases(), 1);
}

// A cancel that comes while a failed layer's slot is being given back (the importer's thread has
// dropped its lock for the release): the slot goes back once, and the id is forgotten.
TEST(EarlyImportTest, ACancelWhileAFailedImportGivesItsSlotBackReleasesItOnce) {
  FakeSlots slots;
  slots.fail_layer_ = 0;
  slots.block_release_ = true;
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(6, 64, 128).ok());
  importer.LayerArrived(6, 0);
  slots.release_entered_.WaitForNotification();
  importer.Verified(6);
  importer.Cancel(6);  // busy: the release in progress is the only one
  EXPECT_EQ(importer.StateOf(6), EarlyImportState::kCancelled);
  slots.release_blocked_.Notify();
  ASSERT_TRUE(Eventually([&] { return !importer.StateOf(6).has_value(); }));
  EXPECT_EQ(slots.releases(), 1);
  EXPECT_EQ(slots.free_slots(), 2);
  EXPECT_EQ(slots.free_pages(), 10);
  EXPECT_TRUE(absl::IsNotFound(importer.Ready(6).status()));
  EXPECT_EQ(importer.active(), 0);
}

TEST(EarlyImportTest, TheImportersEndReleasesEverySlotNotTaken) {
  FakeSlots slots;
  {
    EarlyImporter importer(&slots, kLayers);
    ASSERT_TRUE(importer.Begin(1, 10, 20).ok());
    ASSERT_TRUE(importer.Begin(2, 10, 20).ok());
    for (int64_t layer = 0; layer < kLayers; ++layer) importer.LayerArrived(2, layer);
    importer.Verified(2);
    ASSERT_TRUE(Eventually([&] { return importer.StateOf(2) == EarlyImportState::kReady; }));
    ASSERT_TRUE(importer.Take(2).ok());
  }
  EXPECT_EQ(slots.releases(), 1);  // request 1's; request 2's slot is the runner's
  EXPECT_EQ(slots.free_slots(), 1);
}

// A sequence's pages in a pool of their own, held through a lease as the decode worker holds
// them (owner `id`).
struct HeldPages {
  std::unique_ptr<serving::PagePool> pool;
  std::shared_ptr<const serving::PageLease> lease;
  bool freed() const { return !pool->Table(lease_owner).ok(); }
  serving::RequestId lease_owner = 0;
};

HeldPages Hold(serving::RequestId id) {
  HeldPages held;
  auto pool = serving::PagePool::Create({.kinds = {{"window", 8, 4, 16}}});
  EXPECT_TRUE(pool.ok()) << pool.status();
  held.pool = std::move(*pool);
  auto table = held.pool->Allocate(id, {3});
  EXPECT_TRUE(table.ok()) << table.status();
  held.lease = serving::PageLease::Hold(held.pool.get(), *table);
  held.lease_owner = id;
  return held;
}

// The caller gives up its hold on the pages (the request ended: its ticket released, or it was
// aborted) while a layer's import reads them: they stay the sequence's until that call
// returned, then go back to the pool.
TEST(EarlyImportTest, PagesStayHeldUntilTheRunningImportCallReturns) {
  FakeSlots slots;
  slots.block_layer_ = 1;
  HeldPages held = Hold(5);
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(5, 128, 256, held.lease).ok());
  importer.LayerArrived(5, 1);
  slots.entered_.WaitForNotification();
  held.lease.reset();
  importer.Cancel(5);
  EXPECT_FALSE(held.freed());
  EXPECT_EQ(held.pool->pages_free(0), 5);
  slots.blocked_.Notify();
  ASSERT_TRUE(Eventually([&] { return held.freed(); }));
  EXPECT_EQ(held.pool->pages_free(0), 8);
  ASSERT_TRUE(Eventually([&] { return slots.releases() == 1; }));
}

// Every other end lets go of the pages too: a cancel with no call running, a failed layer, a
// take by the runner, the importer's own end.
TEST(EarlyImportTest, EveryEndOfAnImportLetsGoOfItsPages) {
  FakeSlots slots;
  slots.fail_layer_ = 2;
  std::vector<HeldPages> held;
  for (serving::RequestId id : {1, 2, 3, 4}) held.push_back(Hold(id));
  {
    FakeSlots more;
    EarlyImporter importer(&slots, kLayers);
    EarlyImporter other(&more, kLayers);
    ASSERT_TRUE(importer.Begin(1, 10, 20, held[0].lease).ok());
    ASSERT_TRUE(importer.Begin(2, 10, 20, held[1].lease).ok());
    ASSERT_TRUE(other.Begin(3, 10, 20, held[2].lease).ok());
    ASSERT_TRUE(other.Begin(4, 10, 20, held[3].lease).ok());
    for (HeldPages& h : held) h.lease.reset();
    importer.Cancel(1);
    EXPECT_TRUE(held[0].freed());
    importer.LayerArrived(2, 2);  // fails
    ASSERT_TRUE(Eventually([&] { return importer.StateOf(2) == EarlyImportState::kFailed; }));
    EXPECT_TRUE(held[1].freed());
    for (int64_t layer = 0; layer < kLayers; ++layer) other.LayerArrived(3, layer);
    other.Verified(3);
    ASSERT_TRUE(Eventually([&] { return other.StateOf(3) == EarlyImportState::kReady; }));
    EXPECT_FALSE(held[2].freed());
    ASSERT_TRUE(other.Take(3).ok());
    EXPECT_TRUE(held[2].freed());
    EXPECT_FALSE(held[3].freed());
  }
  EXPECT_TRUE(held[3].freed());
}

}  // namespace

// Reaches EarlyImporter::Apply with events its callers never send (a bug's path).
class EarlyImporterTestPeer {
 public:
  static void Apply(EarlyImporter& importer, serving::RequestId id, EarlyImportEvent event) {
    absl::MutexLock lock(&importer.mu_);
    auto it = importer.records_.find(id);
    ASSERT_NE(it, importer.records_.end());
    importer.Apply(id, it->second, event);
  }
};

namespace {

// An event outside the lifecycle (a bug) fails the import loudly and gives its slot back: at
// once when no import call runs, and right after the running call otherwise.
TEST(EarlyImportTest, AnIllegalEventFailsTheImportAndReleasesItsSlot) {
  FakeSlots slots;
  slots.block_layer_ = 0;
  EarlyImporter importer(&slots, kLayers);
  ASSERT_TRUE(importer.Begin(1, 10, 20).ok());
  ASSERT_TRUE(importer.Begin(2, 64, 128).ok());
  EXPECT_EQ(slots.free_slots(), 0);
  EarlyImporterTestPeer::Apply(importer, 1, EarlyImportEvent::kTaken);
  EXPECT_EQ(importer.StateOf(1), EarlyImportState::kFailed);
  EXPECT_EQ(slots.releases(), 1);
  EXPECT_EQ(slots.free_slots(), 1);
  const absl::StatusOr<bool> ready = importer.Ready(1);
  EXPECT_TRUE(absl::IsFailedPrecondition(ready.status())) << ready.status();
  EXPECT_EQ(importer.StateOf(1), std::nullopt);
  // Request 2 while its layer 0 import runs: the slot goes back when the call returns.
  importer.LayerArrived(2, 0);
  slots.entered_.WaitForNotification();
  EarlyImporterTestPeer::Apply(importer, 2, EarlyImportEvent::kTaken);
  EXPECT_EQ(slots.releases(), 1);
  slots.blocked_.Notify();
  ASSERT_TRUE(Eventually([&] { return importer.StateOf(2) == EarlyImportState::kFailed; }));
  EXPECT_EQ(slots.releases(), 2);
  EXPECT_EQ(slots.free_slots(), 2);
  EXPECT_EQ(slots.free_pages(), 10);
  EXPECT_TRUE(absl::IsFailedPrecondition(importer.Ready(2).status()));
  EXPECT_EQ(importer.active(), 0);
  // A ready import too (its kImportFailed is outside the table: it still ends failed).
  slots.block_layer_ = -1;
  ASSERT_TRUE(importer.Begin(3, 10, 20).ok());
  for (int64_t layer = 0; layer < kLayers; ++layer) importer.LayerArrived(3, layer);
  importer.Verified(3);
  ASSERT_TRUE(Eventually([&] { return importer.StateOf(3) == EarlyImportState::kReady; }));
  EarlyImporterTestPeer::Apply(importer, 3, EarlyImportEvent::kAllCopied);
  EXPECT_EQ(importer.StateOf(3), EarlyImportState::kFailed);
  EXPECT_EQ(slots.releases(), 3);
  EXPECT_EQ(slots.free_slots(), 2);
}

TEST(EarlyImportTest, TransitionsOutsideTheLifecycleAreRefused) {
  using S = EarlyImportState;
  using E = EarlyImportEvent;
  EXPECT_EQ(*NextEarlyImportState(S::kImporting, E::kVerified), S::kVerified);
  EXPECT_EQ(*NextEarlyImportState(S::kCopied, E::kVerified), S::kReady);
  EXPECT_EQ(*NextEarlyImportState(S::kVerified, E::kAllCopied), S::kReady);
  EXPECT_EQ(*NextEarlyImportState(S::kReady, E::kCancel), S::kCancelled);
  EXPECT_EQ(*NextEarlyImportState(S::kFailed, E::kCancel), S::kFailed);
  for (auto [state, event] : {std::pair{S::kImporting, E::kTaken},
                              {S::kVerified, E::kTaken},
                              {S::kTaken, E::kCancel},
                              {S::kReady, E::kImportFailed},
                              {S::kCancelled, E::kVerified},
                              {S::kFailed, E::kAllCopied}}) {
    EXPECT_TRUE(absl::IsFailedPrecondition(NextEarlyImportState(state, event).status()))
        << EarlyImportStateName(state);
  }
}

// PDSERVE_EARLY_IMPORT_BATCH: 0 one layer a call, 1 or unset batched; any other text is warned
// about once and leaves the default (it used to be taken as "batched" without a word).
TEST(BatchEarlyImportLayersTest, TheSwitchTakesZeroAndOneAndWarnsAboutOtherText) {
  const testing::CapturedSwitchWarnings warnings;
  unsetenv("PDSERVE_EARLY_IMPORT_BATCH");
  EXPECT_TRUE(BatchEarlyImportLayers());
  setenv("PDSERVE_EARLY_IMPORT_BATCH", "0", 1);
  EXPECT_FALSE(BatchEarlyImportLayers());
  setenv("PDSERVE_EARLY_IMPORT_BATCH", "1", 1);
  EXPECT_TRUE(BatchEarlyImportLayers());
  EXPECT_TRUE(warnings.lines().empty());
  for (const char* other : {"false", "off", "00"}) {
    setenv("PDSERVE_EARLY_IMPORT_BATCH", other, 1);
    EXPECT_TRUE(BatchEarlyImportLayers()) << other;
  }
  unsetenv("PDSERVE_EARLY_IMPORT_BATCH");
  ASSERT_EQ(warnings.lines().size(), 1u);
  EXPECT_EQ(warnings.lines()[0],
            "PDSERVE_EARLY_IMPORT_BATCH='false' is not accepted (accepted: 0, 1); ignored, using "
            "the default (queued layers imported in one call)");
}

}  // namespace
}  // namespace pdserve::runtime
