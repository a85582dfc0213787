// Fixed-size pages of per-request decode state, one pool per worker, sized by config.
//
// The pool holds one or more page kinds (docs/serving.md maps DeepSeek-V4's state onto them:
// sliding-window rows, compressed entries, indexer keys, compressor buffers). A kind is
// `num_pages` pages of `rows_per_page` rows of `row_bytes` bytes, in one 64-byte-aligned block
// allocated at Create. A page is also the unit the prefill worker ships to the decode worker.
//
// Allocation is all-or-nothing per request: CanAllocate answers whether a demand fits, Allocate
// takes the pages (or fails without changing anything), Free returns them. Every page records its
// owner and an epoch drawn from a pool-wide counter on every allocation and every free, so a handle
// (kind, page, epoch) names one allocation: a handle used after its page was freed or reused, or
// freed twice, is detected with FailedPrecondition. With `poison_freed` (default in debug builds)
// free pages are filled with kPoisonWord, a NaN as fp32 and as both bf16/fp16 halves, so a read
// through a stale pointer yields NaN instead of another request's state.
//
// Thread-safety: every method is safe to call concurrently (one absl::Mutex). The bytes behind a
// span from Data() are not guarded: the owner's single driving thread may use them until it frees
// the request, and Free must happen after the last access (the scheduler's step fence, or in PD
// mode the transfer fence).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::serving {

// Identifies one sequence (one choice of one request) within a worker.
using RequestId = uint64_t;

// 0x7FC57FC5: a quiet NaN as fp32; each 16-bit half 0x7FC5 is a NaN as bf16 and as fp16.
inline constexpr uint32_t kPoisonWord = 0x7FC57FC5u;
#ifdef NDEBUG
inline constexpr bool kPoisonByDefault = false;
#else
inline constexpr bool kPoisonByDefault = true;
#endif

struct PageKind {
  std::string name;           // e.g. "window"; unique within a pool
  int64_t num_pages = 0;      // > 0
  int64_t rows_per_page = 0;  // > 0
  int64_t row_bytes = 0;      // > 0, a multiple of 4
  int64_t page_bytes() const { return rows_per_page * row_bytes; }
};

struct PagePoolOptions {
  std::vector<PageKind> kinds;
  bool poison_freed = kPoisonByDefault;
  // false: the pool is bookkeeping only (owner + epoch per page) for pages whose bytes live
  // elsewhere, e.g. in device memory (engine/gpu's paged state, serving/slot_page_tables.h): no
  // host bytes are allocated, poison_freed is ignored and Data() is FailedPrecondition.
  bool host_memory = true;
  // Empty: the pool allocates each kind's bytes. Otherwise the kinds' bytes are carved from it in
  // order, each kind's start 64-byte aligned: it must be 64-byte aligned, hold HostBytesNeeded()
  // bytes and outlive the pool (the prefill worker's shared region, kvtransfer/shm/).
  std::span<std::byte> host_block;
};

// One allocation of one page. Compare handles with ==; epochs are unique within a pool.
struct PageHandle {
  int32_t kind = 0;
  int32_t page = 0;
  uint64_t epoch = 0;
  friend bool operator==(const PageHandle&, const PageHandle&) = default;
};

// Pages wanted per kind, indexed like PagePoolOptions::kinds.
using PageDemand = std::vector<int64_t>;

// A request's pages: pages[kind][i] is the i-th page of that kind, in allocation order.
struct PageTable {
  RequestId owner = 0;
  std::vector<std::vector<PageHandle>> pages;
  friend bool operator==(const PageTable&, const PageTable&) = default;
};

class PagePool {
 public:
  // Errors: InvalidArgument for no kinds, duplicate or empty names, non-positive sizes, row_bytes
  // not a multiple of 4, or a kind over 2^31 pages; ResourceExhausted if the memory is not there.
  static absl::StatusOr<std::unique_ptr<PagePool>> Create(PagePoolOptions options);
  // The bytes a PagePoolOptions::host_block must hold for `options`' kinds (0 without host memory;
  // a kind too large to address counts as 0: Create reports it).
  static size_t HostBytesNeeded(const PagePoolOptions& options);

  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // True when every kind has at least demand[kind] free pages. False for a malformed demand.
  bool CanAllocate(const PageDemand& demand) const;
  // Takes demand[kind] pages of each kind for `owner`, FIFO from each free list (least recently
  // freed first, which delays reuse). Errors: InvalidArgument for a demand of the wrong size or
  // with negative counts; AlreadyExists if `owner` holds pages; ResourceExhausted naming the first
  // kind short of pages. On error nothing changes.
  absl::StatusOr<PageTable> Allocate(RequestId owner, const PageDemand& demand);
  // Appends demand[kind] pages of each kind to `owner`'s table (a new table if it holds none), for
  // a request whose state grows as it runs. Same order, all-or-nothing and errors as Allocate,
  // but no AlreadyExists. Returns the owner's whole table after the growth.
  absl::StatusOr<PageTable> Extend(RequestId owner, const PageDemand& demand);
  // Returns every page of `table` to the pool (poisoning it if enabled) and bumps its epoch.
  // Errors (nothing freed): FailedPrecondition when a handle is stale (double free, or freeing
  // with a table from before a reuse) or the table is not exactly the owner's current table.
  absl::Status Free(const PageTable& table);

  // The current table of `owner`. NotFound if it holds no pages.
  absl::StatusOr<PageTable> Table(RequestId owner) const;
  // OK when `handle` is `owner`'s live allocation. OutOfRange for a kind or page that does not
  // exist; FailedPrecondition (use after free) when the page was freed or belongs to another
  // allocation, naming the page's current epoch and owner.
  absl::Status Check(RequestId owner, PageHandle handle) const;
  // The page's bytes (page_bytes long, 64-byte aligned) after Check; FailedPrecondition for a
  // pool without host memory.
  absl::StatusOr<std::span<std::byte>> Data(RequestId owner, PageHandle handle);

  // Metrics, each a consistent snapshot of one counter. REQUIRES: 0 <= kind < num_kinds().
  int32_t num_kinds() const { return static_cast<int32_t>(kinds_.size()); }
  const PageKind& kind(int32_t kind) const { return kinds_[kind].spec; }
  int64_t pages_total(int32_t kind) const { return kinds_[kind].spec.num_pages; }
  int64_t pages_free(int32_t kind) const;
  int64_t pages_used(int32_t kind) const { return pages_total(kind) - pages_free(kind); }
  int64_t num_owners() const;  // requests holding pages
  bool poison_freed() const { return poison_freed_; }
  bool host_memory() const { return host_memory_; }
  // Each kind's whole block of page bytes (num_pages * page_bytes, 64-byte aligned), in kind
  // order; empty for a pool without host memory. The blocks live as long as the pool; a
  // transport registers them once for zero-copy (kvtransfer/ucx: UcxTransport::RegisterMemory).
  // The spans carry no ownership: Data() and Free still govern who may touch a page's bytes.
  std::vector<std::span<std::byte>> HostBlocks() const;

 private:
  struct Page {
    std::optional<RequestId> owner;
    uint64_t epoch = 0;
  };
  struct AlignedDelete {
    bool owned = true;  // false: the bytes are the caller's host_block
    void operator()(std::byte* bytes) const;
  };
  struct Kind {
    PageKind spec;
    std::unique_ptr<std::byte[], AlignedDelete> memory;
    std::vector<Page> pages;
    std::deque<int32_t> free_list;
  };

  PagePool(std::vector<Kind> kinds, bool poison_freed, bool host_memory);
  // Allocate (grow false) and Extend (grow true).
  absl::StatusOr<PageTable> Take(RequestId owner, const PageDemand& demand, bool grow);
  // `violation` ("use after free" / "double free") leads the FailedPrecondition message.
  absl::Status CheckLocked(RequestId owner, PageHandle handle, const char* violation) const
      ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  std::byte* PageBytes(const Kind& kind, int32_t page) const;
  void Poison(const Kind& kind, int32_t page) const;

  const bool poison_freed_;
  const bool host_memory_;
  mutable absl::Mutex mutex_;
  // The vector's shape and each Kind's spec and memory pointer never change after Create;
  // pages, free lists and the owner map are guarded.
  std::vector<Kind> kinds_;
  uint64_t next_epoch_ ABSL_GUARDED_BY(mutex_) = 1;
  absl::flat_hash_map<RequestId, PageTable> tables_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace pdserve::serving
