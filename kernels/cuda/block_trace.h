// Block timelines of instrumented kernels, for benchmarks (bench/cuda's PDSERVE_BLOCK_TRACE):
// where the time of a short decode kernel goes between its first block's start and its last
// block's end (launch ramp, the dependency wait, uneven blocks, the tail).
//
// A launcher of an instrumented kernel (fp8_gemm_wgmma / fp8_gemm_w8a16_wgmma's GEMM kernel,
// sparse_decode_attention's split kernel, the select top-k kernels: their marks below) reads
// block_trace() when it builds the launch and, if it is set, passes it to the kernel, whose blocks
// with linear index i < capacity write slots [12 i, 12 i + 12) (kBlockTraceSlots): start
// (%globaltimer, ns, at entry), dependency (ns, when griddepcontrol.wait returned in the block's
// first consumer thread; 0 where the kernel has none), end (ns, the latest exit of the block's
// warps), the multiprocessor (%smid), then four marks of the first consumer thread (0 where not
// recorded): its setup done (the GEMM: W8A16's scales staged, W8A8's scale copies issued; the
// attention: the queries landed), its first stage of data landed and its last (the attention and
// TmaStreamKernel only: in the GEMM's loop the marks cost registers), its main loop done (before
// the epilogue). The select top-k's marks (thread 0): setup = the sample's threshold known (rows of
// at most 4096: the row loaded), first data = its part gathered, last data = the row's lists
// counted after the row barrier, loop done = the picks placed (the row's first block) or the last
// row barrier passed. The launcher does not reset the slots: the caller zeroes them before the
// traced launch (end is an atomicMax). Plain C++ (no device code). Thread-safety: one process-wide
// setting, meant for a benchmark's single launching thread; a CUDA graph captured while it is set
// keeps the pointer in its nodes.
#pragma once

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int kBlockTraceSlots = 12;
enum BlockTraceMark : int {
  kTraceSetup = 4,
  kTraceFirstData = 5,
  kTraceLastData = 6,
  kTraceLoopDone = 7,
  // Kernel-specific marks (the select top-k: its request's length read, its sample landed, its
  // part's loads landed, the row's first block holding every block's list in registers), 0 where
  // not recorded.
  kTraceExtra0 = 8,
  kTraceExtra1 = 9,
  kTraceExtra2 = 10,
  kTraceExtra3 = 11
};

struct BlockTrace {
  uint64_t* slots = nullptr;  // device, [capacity, kBlockTraceSlots]
  int64_t capacity = 0;       // blocks
};

// Sets (slots != nullptr) or clears the trace the next instrumented launches take.
void set_block_trace(uint64_t* slots, int64_t capacity);
BlockTrace block_trace();

}  // namespace pdserve::kernels::cuda
