// XXH3-64 (seed 0, default secret) of a batch of pages in device memory: the checksum the
// transfer protocol puts in every page header (docs/protocol.md; kvtransfer/page_header.h's
// PagePayloadChecksum, libxxhash XXH3_64bits), computed where the pages are. CPU twin: libxxhash
// itself. The math is the specification's (kernels/cuda/xxh3_scalar.cuh); pages over 240 bytes
// take a block-parallel form of the long hash:
//   - one thread block per page; each 1024-byte block of the page adds, per accumulator lane,
//     a sum that does not depend on the accumulators (the stripes' products and words), so a
//     tile of 32 blocks is summed by 256 threads at once (thread = block x lane, 16 stripes
//     each), and eight threads then run the tile's scramble chain, which is sequential;
//   - the last (partial) block, the last stripe and the final merge as the specification says.
// Additions are modulo 2^64 and commute, so the parallel sums equal the specification's
// stripe-by-stripe order bit for bit.
//
// Pages may start at any address (8-aligned pages use 8-byte loads; others byte loads) and have
// any length, 0 to 2^62. One page per thread block: a batch of many 64-128 KiB pages (the state
// pages) fills the GPU; a single multi-MiB page runs on one SM.
//
// CUDA-graph safe: no allocation, no synchronization; the launch shape depends on num_pages only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/page_copy.cuh"

namespace pdserve::kernels::cuda {

// One page: `data` a device address readable by the kernel (own allocation or a peer's IPC
// mapping), `length` bytes.
struct Xxh3Page {
  const void* data;
  uint64_t length;
};

// hashes[i] = XXH3_64bits(pages[i].data, pages[i].length) for i < num_pages. `pages` and
// `hashes` in device memory. num_pages >= 0 (0 launches nothing); pages / hashes non-null when
// num_pages > 0; num_pages < 2^31. Returns cudaErrorInvalidValue on bad arguments (the refusal
// names the check: kernels/cuda/launch_check.h), else the launch status. Asynchronous on
// `stream`; reads the pages and writes hashes only.
cudaError_t xxh3_64_pages(const Xxh3Page* pages, int64_t num_pages, uint64_t* hashes,
                          cudaStream_t stream);

// For i < num_pages: copies[i] as copy_pages does it (kernels/cuda/page_copy.cuh), then
// hashes[i] = XXH3_64bits of the destination's bytes as they landed, both by one thread block in
// one launch (the receiving side of a device-to-device page transfer checksums what is in its
// own memory, not the source). `copies` and `hashes` readable / writable by the device (device
// memory, or pinned host memory under unified addressing); the same argument checks and errors
// as copy_pages. Asynchronous on `stream`.
cudaError_t copy_pages_xxh3(const PageCopy* copies, int64_t num_pages, uint64_t* hashes,
                            cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
