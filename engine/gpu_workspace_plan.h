// GpuModel's workspaces beyond its activation rows, and the GPU sampler's, as host arithmetic for
// the memory plan (engine/memory_plan.h). Each figure comes from the formula the allocating code
// uses, shared through a host header:
// - the dense FP8 GEMMs' workspace (GpuModel::Impl::AllocateFp8): kernels/cuda/fp8_gemm_workspace.h
//   (fp8_workspace::ProjectionBytes), over the FP8 projections the plan derives from the config
//   (DenseFp8Projections);
// - W8A8's shared activation-quant rows (AllocateSharedActQuant, engine/gpu/gpu_model_quant.cc):
//   SharedActQuantBuffers below, which the engine allocates with;
// - the grouped o_a's workspace (AllocateFused, engine/gpu/gpu_model_fused.cc):
//   kernels/cuda/moe_gemm_workspace.h (moe_workspace::AutoPathBytes) over 1 .. kOaGroupedMaxRows;
// - decode attention's split partials (Allocate's attn_workspace): kernels/cuda/
//   sparse_decode_workspace.h over the decode buckets and layer kinds, on kPlanSmCount
//   multiprocessors;
// - the GPU sampler's workspace and outputs (runtime/cuda/gpu_sampler.cc): kernels/cuda/
//   sampling_workspace.h (CUB's sort storage as CUDA 13's CUB asks for it).
// Thread-safety: pure functions (DenseFp8WorkspaceBytes keeps a thread_local cache).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/config.h"

namespace pdserve::engine {

// Fused FP8 o_a (GpuModelOptions::fused_projections) runs as one moe_grouped_gemm up to this many
// rows, the per-group fp8_gemm calls above: moe_gemm is a decode kernel (kernels/cuda/
// moe_gemm.cuh). A guess, not measured (tools/gpu/run_fused_projections.sh times decode steps).
inline constexpr int64_t kOaGroupedMaxRows = 64;

// The multiprocessors the plan's decode attention split rule assumes (H100 SXM and H200: 132).
inline constexpr int kPlanSmCount = 132;

// e4m3 bytes and fp32 scales (elements) of [rows, k] quantized in column groups of group_cols
// (act_quant's ActGroups: each group its own matrix, 256-byte aligned; kernels/cuda/
// act_quant.cuh ActGroupBytes / ActGroupScales, which tests/engine_gpu compares).
int64_t ActQuantGroupBytes(int64_t rows, int64_t k, int64_t group_cols);
int64_t ActQuantGroupScales(int64_t rows, int64_t k, int64_t group_cols);

// GpuModelOptions::fp8_shared_act_quant as PDSERVE_FP8_SHARED_ACT_QUANT overrides it ("1" on,
// "0" off, else `option`). Reads the environment on each call.
bool SharedActQuantOption(bool option);

// The shared act-quant buffers at max_rows rows (AllocateSharedActQuant): slot 0 the normed
// hidden state and o_a's output, slot 1 q_a's output, the shared expert's SwiGLU and the
// attention output in o_a's column groups; e4m3 bytes and fp32 scale elements each.
struct SharedActQuantBytes {
  int64_t rows0 = 0, scales0 = 0, rows1 = 0, scales1 = 0;
  int64_t bytes() const { return rows0 + 4 * scales0 + rows1 + 4 * scales1; }
};
SharedActQuantBytes SharedActQuantBuffers(const ModelConfig& config, int64_t max_rows);

// The dense FP8 projections ([n, k] per fp8_gemm call; o_a per group) of a `weights: fp8` engine
// on a quantized checkpoint: the non-expert `_proj` matrices whose input width is a multiple of
// 128 (memory_plan.cc's Fp8ResidentBytes rule), with the attention-input and shared-expert
// gate / up groups stacked (engine/fused_projections.h) when `fused`. Distinct shapes.
std::vector<std::pair<int64_t, int64_t>> DenseFp8Projections(const ModelConfig& config, bool fused);

// The GpuModel workspaces the plan counts for one rank at max_rows rows and `slots` slots
// (decode buckets: the powers of two below slots, and slots) of `context` tokens.
struct WorkspaceBytes {
  int64_t dense_fp8 = 0;    // fp8_workspace (FP8 projections resident)
  int64_t act_quant = 0;    // act_q / act_s (W8A8 with fp8_shared_act_quant)
  int64_t o_a_grouped = 0;  // o_a_workspace (FP8 o_a, fused projections)
  int64_t attention = 0;    // attn_workspace (fixed-shape decode attention)
  int64_t sampler = 0;      // GpuSampler (decode workers)
  int64_t total() const { return dense_fp8 + act_quant + o_a_grouped + attention + sampler; }
};
struct WorkspaceRequest {
  int64_t max_rows = 256;
  int64_t slots = 1;
  int64_t context = 0;
  bool fp8_projections = false;   // `weights: fp8` on a quantized checkpoint
  bool w8a8 = false;              // fp8_activations: fp8
  bool shared_act_quant = false;  // SharedActQuantOption, with w8a8
  bool sampler = false;           // a decode worker: GpuStepRunner's GpuSampler
};
WorkspaceBytes GpuWorkspaceBytes(const ModelConfig& config, const WorkspaceRequest& request);

// Each part alone (GpuWorkspaceBytes' terms). The dense FP8 figure is the largest over the fused
// and unfused projections (the plan does not see PDSERVE_FUSED_PROJECTIONS) at the default
// PDSERVE_FP8_GEMM and wgmma config.
int64_t DenseFp8WorkspaceBytes(const ModelConfig& config, int64_t max_rows, bool shared_act_quant);
int64_t OaGroupedWorkspaceBytes(const ModelConfig& config, int64_t max_rows, bool w8a16);
int64_t DecodeAttentionWorkspaceBytes(const ModelConfig& config, int64_t slots, int64_t context);
int64_t SamplerBytes(const ModelConfig& config, int64_t slots);

}  // namespace pdserve::engine
