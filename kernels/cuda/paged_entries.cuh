// Where a request's compressed entry lives in a paged entry pool: the page-table indirection the
// engine's paged state (serving/slot_page_tables.h) gives the compressor, sink attention and the
// any-shape indexer (the fixed-shape decode kernels take per-row page tables of the same pools).
//
// With table == nullptr the pool is the slot layout: request slot s's entry e is row
// s * capacity + e. Otherwise entry e of slot s is row table[s * stride + e / page_size] *
// page_size + e % page_size: table is int32 [slots, stride] in device memory (device page ids,
// read when the kernel runs, so a CUDA graph replays against the current tables), and every page
// a kernel touches must be one the slot holds (e < the entries its position implies).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cuda {

struct EntryPages {
  const int32_t* table = nullptr;  // nullptr: the slot layout
  int64_t stride = 0;              // table row length (pages per slot at most)
  int64_t page_size = 0;           // entries per page, >= 1 when table != nullptr
};

#ifdef __CUDACC__
// The pool row of entry e of slot `slot` (capacity: the slot layout's entries per slot).
__device__ __forceinline__ int64_t EntryRow(const EntryPages& pages, int64_t slot, int64_t capacity,
                                            int64_t e) {
  if (pages.table == nullptr) return slot * capacity + e;
  const int64_t page = pages.table[slot * pages.stride + e / pages.page_size];
  return page * pages.page_size + e % pages.page_size;
}
#endif

// A launcher's check: a paged view needs a positive page size and a stride that covers
// `capacity` entries.
inline bool EntryPagesValid(const EntryPages& pages, int64_t capacity) {
  if (pages.table == nullptr) return true;
  return pages.page_size >= 1 && pages.stride >= 0 && pages.stride * pages.page_size >= capacity;
}

}  // namespace pdserve::kernels::cuda
