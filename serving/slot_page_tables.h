// Page tables of a slot-indexed engine whose growing state lives in paged device pools (the CUDA
// engine's compressed entries and indexer keys, engine/gpu/gpu_model.h). Pure logic over a
// bookkeeping-only serving::PagePool (host_memory false): which pool pages each slot's request
// holds, grown as the request's position advances and freed when the slot is released, plus the
// host mirror of the int32 page-table rows the kernels read (copied to device memory by the
// engine before each launch).
//
// Kinds: one per compression rate (a V4 model has rate 4 for CSA entries and indexer keys, rate
// 128 for HCA entries). A page of a kind holds `page_entries` entries of every layer of that kind
// (the same page index in each layer's pool, as vLLM's block tables are shared across layers), so
// one table row per kind and slot serves all its layers. A request at position p holds p / rate
// entries (at most `entry_capacity`) in ceil(entries / page_entries) pages.
//
// Device page ids: row entries name device pages, pool page + 1; device page 0 is the null page,
// never allocated, which the engine fills with NaN: a row entry past the pages a slot holds is 0,
// so a read the kernels should never make lands on NaN inside the pool, not outside it.
// Fixed mode (the slot layout, a reference for tests): slot s always names device pages 1 + s *
// stride + i, no allocator; Grow never fails within max_context.
//
// Ownership (paranoid mode, docs/guards.md): each slot's request is a fresh pool owner from Create
// or its last Release; Verify checks every page the slot's row names against the allocator
// (owner + epoch), before a step is launched.
//
// Thread-safety: not thread-safe (the engine's single driving thread); the pool it owns is.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "serving/page_pool.h"

namespace pdserve::serving {

struct SlotPageKind {
  std::string name;            // e.g. "rate4"
  int64_t rate = 0;            // tokens per entry, >= 1
  int64_t entry_capacity = 0;  // entries per request at most, a multiple of page_entries, >= 0
  int64_t pool_pages = 0;      // pages over all slots (paged mode), >= 1
};

struct SlotPageTablesOptions {
  int64_t slots = 0;          // table rows 0 .. slots - 1, plus row `slots` (scratch, no pages)
  int64_t page_entries = 64;  // entries per page
  std::vector<SlotPageKind> kinds;
  bool fixed = false;  // the slot layout: pool_pages ignored (slots * stride)
};

class SlotPageTables {
 public:
  // InvalidArgument for no slots, no kinds, a non-positive rate or page size, a capacity that is
  // not a multiple of page_entries, or no pool pages.
  static absl::StatusOr<std::unique_ptr<SlotPageTables>> Create(SlotPageTablesOptions options);

  int64_t num_kinds() const { return static_cast<int64_t>(options_.kinds.size()); }
  const SlotPageKind& kind(int64_t k) const { return options_.kinds[static_cast<size_t>(k)]; }
  bool fixed() const { return options_.fixed; }
  // Row length of kind k: entry_capacity / page_entries.
  int64_t stride(int64_t k) const;
  // Device pages a pool of kind k needs (the null page included): pool_pages + 1, or in fixed
  // mode slots * stride + 1.
  int64_t device_pages(int64_t k) const;
  // Pages kind k needs for a request at `position` tokens.
  int64_t PagesAt(int64_t k, int64_t position) const;
  // Pages slot s holds of kind k.
  int64_t held(int64_t k, int64_t slot) const;
  int64_t pages_free(int64_t k) const;  // fixed mode: the pages no slot holds
  serving::RequestId owner(int64_t slot) const { return owners_[static_cast<size_t>(slot)]; }

  // Whether every (slot, position) target can hold its position at once (pages already held
  // count). False for a bad slot.
  bool CanGrow(std::span<const std::pair<int64_t, int64_t>> targets) const;
  // Grows each target slot to hold its position: all or nothing. InvalidArgument for a bad or
  // repeated slot; ResourceExhausted (nothing changed) when the pool is short.
  absl::Status Grow(std::span<const std::pair<int64_t, int64_t>> targets);
  // Frees slot s's pages (its row goes back to the null page) and gives the slot a new owner.
  // InvalidArgument for a bad slot; the allocator's error if its table was tampered with.
  absl::Status Release(int64_t slot);

  // Host mirror of kind k's rows: [slots + 1, stride] device page ids.
  std::span<const int32_t> Rows(int64_t k) const { return rows_[static_cast<size_t>(k)]; }
  std::span<const int32_t> Row(int64_t k, int64_t slot) const;
  // Slots whose rows changed since the last call, ascending (each once); clears the set.
  std::vector<int64_t> TakeDirty();

  // Paranoid check of slot s: every page its rows name is the page the allocator handed the
  // slot's current owner, at the same epoch. FailedPrecondition naming the slot, kind, index and
  // the allocator's verdict otherwise; OK for a slot holding nothing and in fixed mode.
  absl::Status Verify(int64_t slot) const;

  // Test faults (isolation tests): hand page 0 of the first kind `donor` holds to `victim` as
  // the victim's page 0 (its row and its record), as an allocator bug would. FailedPrecondition
  // when either slot holds no page of a kind they both have.
  absl::Status InjectForeignPageForTest(int64_t victim, int64_t donor);

 private:
  explicit SlotPageTables(SlotPageTablesOptions options, std::unique_ptr<PagePool> pool);
  absl::Status CheckSlot(int64_t slot) const;
  int32_t* MutableRow(int64_t k, int64_t slot);

  SlotPageTablesOptions options_;
  std::unique_ptr<PagePool> pool_;  // null in fixed mode
  // handles_[slot][k]: the pages the engine believes slot holds (kept apart from the pool's own
  // table so Verify can compare the two).
  std::vector<std::vector<std::vector<PageHandle>>> handles_;
  std::vector<int64_t> fixed_held_;  // fixed mode: [slot * kinds + k] pages "held"
  std::vector<std::vector<int32_t>> rows_;
  std::vector<serving::RequestId> owners_;
  serving::RequestId next_owner_ = 1;
  std::vector<char> dirty_;
};

}  // namespace pdserve::serving
