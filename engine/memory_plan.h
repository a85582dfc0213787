// The memory plan of a worker's GPUs (issue 25, `pdserve plan`): bytes for weights, decode state,
// activations and CUDA graphs per GPU, and the largest batch x context that fit, computed from a
// model directory's config.json and safetensors headers before anything is loaded.
//
// Sources of each figure (docs/memory-plan.md has the tables and what is assumed):
// - Weights: the checkpoint's safetensors headers (model.safetensors or the shards of
//   model.safetensors.index.json; only headers are read), else, for a directory without a
//   checkpoint, RequiredTensors(config) shapes in the stored formats of StoredFormatOf (what a
//   DeepSeek-V4 release stores when config.json has a quantization_config) or in config.json's
//   `dtype` (bf16) without one. The routed experts are split over an expert-parallel group
//   (engine/expert_parallel.h: the largest rank holds ceil(E / world) experts); everything else is
//   replicated on every GPU (docs/engine-gpu.md, "Several GPUs"). "today" is what the CUDA engine
//   holds now: every matrix bf16, the router, vectors and hyper-connections fp32
//   (engine/gpu/gpu_model_load.cc, UploadLinear / UploadF32).
// - Decode state on a GPU: the slot pools of engine/gpu/gpu_model_impl.h (Layer::window_ring,
//   CompressorWeights::Load) in the ring layout of engine/ring_state.h: per layer a bf16 window
//   [W, head_dim], per compressor fp32 kv and gate rings [2m, width] and bf16 entries
//   [RingEntryCapacity(context, m, 64), dim]; slots + 1 per rank (the scratch slot).
// - Host state pool: serving/state_layout.h page kinds (fp32 rows), as PagePool allocates them.
// - Activations: GpuModel::Impl::Allocate (engine/gpu/gpu_model_load.cc) at max_rows =
//   max(max_chunk, slots per rank), the fused projections' buffers included (engine/gpu/
//   gpu_model_fused.cc; counted even when the option is off). Their weights add no bytes on
//   V4-Flash / V4-Pro (the parts are views into the stacked weight, no padding rows there:
//   engine/fused_projections.h); on other shapes the padding rows (FusedPaddingRows) are not
//   counted.
// - Workspaces (engine/gpu_workspace_plan.h, each the allocating code's own formula): the dense
//   FP8 GEMMs', W8A8's shared act-quant rows, the grouped o_a's (FP8 projections resident), the
//   decode attention's, the GPU sampler's (decode). Not counted (docs/memory-plan.md has the
//   list): the import's and the CUDA IPC landers' page descriptors (mapped pinned host memory at
//   the defaults), the sampler's input staging and the local expert-parallel transport's staging
//   (grown on demand).
// - FP8 experts (`weights: fp8` on a quantized checkpoint): GpuFp8ExpertBytes.
// - CUDA IPC (transfer.cuda_ipc): PlanRequest::cuda_ipc_*, runtime/cuda_ipc_memory.h.
// - CUDA graphs, CUDA context, cuBLAS and NCCL: not measured; a fixed allowance (kGraphAllowance
//   per captured decode bucket, kRuntimeAllowance per GPU), said so in the output.
//
// Thread-safety: pure functions over their arguments (PlanWeightBytes reads files;
// GpuFp8ExpertBytes keeps a thread_local cache of its running maximum).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/gpu_workspace_plan.h"

namespace pdserve::engine {

inline constexpr int64_t kGiB = int64_t{1} << 30;
inline constexpr int64_t kMiB = int64_t{1} << 20;
// One H200's HBM as the plan counts it (nvidia-smi reports 143771 MiB).
inline constexpr int64_t kH200Bytes = 140 * kGiB;
inline constexpr int64_t kGraphAllowance = 16 * kMiB;   // per captured decode bucket (assumed)
inline constexpr int64_t kRuntimeAllowance = 1 * kGiB;  // context, cuBLAS, NCCL (assumed)

// How a tensor is stored when the release's quantization applies.
enum class StoredFormat { kFp8Block, kFp4Expert, kBf16, kF32, kI32 };
const char* StoredFormatName(StoredFormat f);  // "fp8", "fp4", "bf16", "f32", "i32"
// The stored format of canonical tensor `name` in a DeepSeek-V4 release layout: routed experts
// FP4 (e2m1 two per byte + ue8m0 scales per 1 x 32), embeddings / lm_head / router gate bf16,
// other 2-D `.weight` matrices FP8 e4m3 (+ ue8m0 scales per 128 x 128), tid2eid i32, every other
// tensor (norms, hyper-connections, sinks, position biases, correction bias) f32. The same rule
// as tools/make_real_format_checkpoint.py.
StoredFormat StoredFormatOf(const std::string& name, size_t rank, bool integer);
// Bytes of a tensor of `shape` stored as `format`, scales included.
int64_t StoredBytes(StoredFormat format, const std::vector<int64_t>& shape);

struct WeightBytes {
  std::string source;            // where the figures come from, for the output
  int64_t experts = 0;           // routed experts (+ their scales) as stored
  int64_t replicated = 0;        // everything else as stored
  int64_t experts_today = 0;     // the CUDA engine's bf16 experts
  int64_t replicated_today = 0;  // the CUDA engine's copy of the rest
  // The CUDA engine's bytes in `--weights fp8` (engine/gpu/gpu_model.h, kFp8Block) for a
  // quantized checkpoint: routed experts and `_proj` matrices e4m3 + fp32 128 x 128 scales (FP4
  // experts converted at load: twice their stored bytes), the rest as today. For a bf16
  // checkpoint the same as today.
  int64_t experts_fp8 = 0;
  int64_t replicated_fp8 = 0;
  int64_t host_fp32 = 0;                    // Weights::Load's float32 copy of every tensor
  std::map<std::string, int64_t> by_dtype;  // stored bytes per dtype name
};

// Reads `model_dir`'s checkpoint headers (or, without a checkpoint, config.json as above).
// Errors: NotFound / InvalidArgument from the files, naming them.
absl::StatusOr<WeightBytes> PlanWeightBytes(const std::string& model_dir,
                                            const ModelConfig& config);
// The config-only figures (no checkpoint): `quantized` picks StoredFormatOf, else bf16 / f32.
WeightBytes WeightBytesFromConfig(const ModelConfig& config, bool quantized);

// One request's decode state in the CUDA engine's slot pools at `context` tokens, per kind.
struct SlotStateBytes {
  int64_t window = 0;      // bf16 sliding-window rings, every layer
  int64_t rings = 0;       // fp32 compressor kv + gate rings (CSA, HCA, indexer)
  int64_t compressed = 0;  // bf16 CSA + HCA entries
  int64_t indexer = 0;     // bf16 indexer keys (CSA layers)
  int64_t total() const { return window + rings + compressed + indexer; }
};
SlotStateBytes GpuSlotStateBytes(const ModelConfig& config, int64_t context);

// Bytes of the host page pool a worker allocates for `max_sequences` sequences and
// `token_capacity` tokens (fp32 rows; serving::StateLayout::PoolOptions).
int64_t HostPoolBytes(const ModelConfig& config, int64_t max_sequences, int64_t token_capacity,
                      int64_t entries_per_page = 64);

// Device workspace of one GpuModel rank at `max_rows` rows (GpuModel::Impl::Allocate).
int64_t GpuActivationBytes(const ModelConfig& config, int64_t max_rows, int64_t context, int world);

// The FP8 routed experts' device buffers of one GpuModel rank at `max_rows` rows
// (GpuModel::Impl::AllocateFp8Experts, allocated when the experts are resident FP8: `weights:
// fp8` on a quantized checkpoint): the bf16 gate_up, activation and down rows of every pick of
// the group's world * max_rows rows, and moe_grouped_gemm's workspace, the largest any call of
// 1 .. world * max_rows tokens takes for either projection over the largest rank's
// ceil(E / world) experts (kernels/cuda/moe_gemm_workspace.h, the kernels' own formula, at
// PDSERVE_MOE_GEMM=auto and the default PDSERVE_MOE_WGMMA; from kMoeWgmmaMinPicks picks on the
// wgmma path's grouped rows dominate). `w8a16`: fp8_activations bf16 (the default).
struct Fp8ExpertBytes {
  int64_t outputs = 0;
  int64_t workspace = 0;
  int64_t total() const { return outputs + workspace; }
};
Fp8ExpertBytes GpuFp8ExpertBytes(const ModelConfig& config, int64_t max_rows, int world,
                                 bool w8a16);

// Decode buckets a GpuModel with `slots` slots captures (powers of two below slots, and slots).
int64_t DecodeBuckets(int64_t slots);

struct PlanRequest {
  std::string worker = "worker";  // names the worker in messages
  bool prefill = false;           // prefill: one sequence per rank
  int world = 1;                  // GPUs of the expert-parallel group
  int64_t max_batch = 64;         // sequences of the worker (decode)
  int64_t max_context = 0;        // tokens per sequence
  int64_t max_chunk = 256;        // rows per Forward call (runtime::GpuBackendOptions)
  int64_t gpu_bytes = kH200Bytes;
  // The worker's `weights: fp8`: the engine holds WeightBytes::*_fp8, not *_today.
  bool fp8_weights = false;
  // The worker's `fp8_activations: fp8` (W8A8; default bf16: W8A16).
  bool fp8_activations = false;
  // GpuModelOptions::fp8_shared_act_quant as the worker's engine gets it (SharedActQuantOption:
  // PDSERVE_FP8_SHARED_ACT_QUANT=1); counted with fp8_activations on FP8 projections.
  bool fp8_shared_act_quant = false;
  // The routed experts are resident FP8 (GpuFp8ExpertBytes counts): fp8_weights on a quantized
  // checkpoint. FormatPlan, CheckPlanFits and AutoStateTokens set it from their WeightBytes.
  bool fp8_experts = false;
  // Decode: the paged device state pools hold this many tokens over the whole group
  // (`pdserve serve --state-tokens`, engine/paged_state_plan.h); 0: every slot full.
  int64_t state_tokens = 0;
  // transfer.cuda_ipc's device memory on the worker's first GPU (runtime::PlanCudaIpcMemory, the
  // workers' own formula): the prefill worker's arena, the decode worker's device page pool, for
  // requests of cuda_ipc_tokens tokens; 0 without the path. Counted on the plan's GPU (the
  // largest rank), so a group's plan is its first GPU's.
  int64_t cuda_ipc_arena_bytes = 0;
  int64_t cuda_ipc_pool_bytes = 0;
  int64_t cuda_ipc_tokens = 0;
};

// The plan of one GPU of the group (the largest rank), in one precision.
struct GpuPlan {
  int64_t weights = 0;
  int64_t state = 0;
  int64_t activations = 0;
  int64_t graphs = 0;        // allowance
  int64_t runtime = 0;       // allowance
  int64_t transfer = 0;      // transfer.cuda_ipc: arena + device page pool (PlanRequest)
  int64_t fp8_experts = 0;   // GpuFp8ExpertBytes (PlanRequest::fp8_experts)
  WorkspaceBytes workspace;  // GpuWorkspaceBytes (FP8 GEMMs with fp8_experts, attention, sampler)
  int64_t slots = 0;         // per rank, without the scratch slot
  int64_t total() const {
    return weights + state + activations + graphs + runtime + transfer + fp8_experts +
           workspace.total();
  }
  // Largest batch (whole group) at the request's context, and largest context at its batch;
  // 0 when none fits.
  int64_t max_batch_at_context = 0;
  int64_t max_context_at_batch = 0;
};
GpuPlan PlanGpu(const ModelConfig& config, int64_t expert_bytes, int64_t replicated_bytes,
                const PlanRequest& request);

// The plan as text (both precisions, the batch x context table, and the paged state's capacity:
// requests of 8K / 32K / 128K tokens admitted at once with the request's state_tokens, and how
// many would fit the GPU's state budget paged vs slot layout) for `pdserve plan`.
std::string FormatPlan(const ModelConfig& config, const WeightBytes& weights,
                       const PlanRequest& request);

// OK when the CUDA engine as it is today (bf16 weights) fits the request; else ResourceExhausted
// naming the worker, the bytes, and what to change (more GPUs, fewer layers per GPU, a smaller
// context, a smaller batch; with CUDA IPC memory that alone is enough, a smaller
// transfer.cuda_ipc_arena_tokens or transfer.cuda_ipc off), with the figure that would fit where
// one exists.
absl::Status CheckPlanFits(const ModelConfig& config, const WeightBytes& weights,
                           const PlanRequest& request);

// Share of each GPU that `state_tokens: auto` leaves unplanned: the graph and runtime figures are
// allowances, not measurements, and allocators fragment.
inline constexpr double kAutoStateMargin = 0.05;

// `state_tokens: auto` (decode worker key; `pdserve serve --state-tokens auto`): the largest
// state_tokens over the whole group (a multiple of `request.world`) whose paged pools fit each GPU
// beside the engine's weights (the request's weight format), activations and the graph and
// runtime allowances, with kAutoStateMargin of the GPU left over (PlanGpu's figures); at most
// world * ceil(max_batch / world) * max_context, every slot full. request.state_tokens is
// ignored. InvalidArgument for a prefill request; ResourceExhausted, naming the bytes, when not
// even one token of paged state fits.
absl::StatusOr<int64_t> AutoStateTokens(const ModelConfig& config, const WeightBytes& weights,
                                        const PlanRequest& request);

}  // namespace pdserve::engine
