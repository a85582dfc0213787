// The DeepSeek-V4 causal language model on the CUDA backend: the CPU engine's forward pass
// (engine/model.h, same math and one-shot semantics) with bf16 weights and bf16 state, fp32
// activations and accumulation, cuBLAS GEMMs and the kernels of kernels/cuda.
//
// Requests live in state slots. The state that grows with tokens (each compressed layer's entries
// and the indexer keys) is paged: pools of kPageSize-entry pages per layer, one page table per
// compression rate and slot (serving/slot_page_tables.h), pages taken as a slot's position
// advances and freed by ResetSlot, so memory follows the tokens requests hold, not max_context
// (docs/engine-gpu.md, "Paged state"). The fixed-size state (sliding-window ring, compressor
// partial windows) stays one block per slot. The page tables live in device memory at fixed
// addresses and the kernels read them when they run, so one decode step for any set of slots has
// a fixed launch shape. Forward() extends one slot by a
// chunk of tokens (prefill, chunked prefill, or one decode token); DecodeStep() runs one token
// for each of several slots at once, padded to a batch-size bucket, either eagerly or as the
// bucket's captured CUDA graph (the two give identical bits: same kernels, same shapes).
//
// Precision: GEMM inputs are rounded to bf16 (weights stored bf16; activations rounded per GEMM),
// products accumulate in fp32 (cuBLAS compute type 32F); norms, softmax, hyper-connections and
// routing run in fp32; the hyper-connection mixes keep fp32 weights. The state (window rows,
// compressed entries, indexer keys) is stored bf16; the compressors' raw partial windows fp32.
//
// Attention runs through kernels/cuda/sink_attention.cuh (any shape) and the indexer through
// kernels/cuda/indexer_generic.cuh + top_k; decode steps at DeepSeek-V4 shapes through the
// fixed-shape kernels (sparse_decode_attention.cuh, indexer.cuh) on paged views of the same pools.
//
// Expert parallelism (GpuModelOptions::expert_comm; docs/engine-gpu.md, "Several GPUs"): the
// model is one rank of a group. It holds only its block of routed experts (ExpertShardOf); the
// rest is replicated and runs on the rank's own requests (data-parallel attention). A MoE layer
// all-gathers the group's rows (bf16 inputs, picks, weights), runs the rank's experts on every
// row and reduce-scatters the fp32 partial sums back to the rows' ranks. So every call that runs
// the forward pass (Forward, DecodeStep, Idle) is a lock-step call of the group: all ranks make
// one at the same time with the same padded row count (the group_rows arguments; a rank with no
// work calls Idle or an empty DecodeStep). engine/gpu/gpu_model_group.h drives that.
//
// Thread-safety: not thread-safe; one caller at a time drives a GpuModel (it owns one CUDA
// stream), from any thread: each call makes options.device current on the calling thread. The
// ranks of a group are driven by one thread each, concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/chunk_logits.h"
#include "engine/config.h"
#include "engine/gpu/expert_comm.h"
#include "engine/gpu/state_staging.h"
#include "engine/state.h"
#include "engine/tensor.h"
#include "engine/weights.h"

namespace pdserve::engine::gpu {

// How activations and weights enter the dense GEMMs.
enum class GemmInputs {
  kBf16,  // both bf16, fp32 accumulation (the production path)
  // fp32 activations times the same bf16-rounded weight values held as fp32 (SGEMM, no TF32):
  // a reference mode for precision studies and tests. Twice the weight memory; the routed
  // experts (kernels/cuda/moe.cuh) and the state stay bf16.
  kFp32,
};

// How the dense projections' weights are held on the device.
enum class WeightFormat {
  kBf16,  // every projection bf16, rounded from the host's fp32 engine::Weights (today's path)
  // Every dense projection the checkpoint stores FP8 e4m3 with 128 x 128 block scales (q_a / q_b /
  // kv / o_a / o_b, the compressors' and indexer's projections, the shared experts) stays so on
  // the device: the stored bytes are copied from the mmapped checkpoint (engine/stored_fp8.h,
  // GpuModelOptions::checkpoint_dir) with fp32 scales beside them, and multiplied by
  // kernels/cuda/fp8_gemm (activations quantized per 1 x 128 on the fly, bf16 out, then fp32).
  // A projection stored otherwise (bf16 / fp32), or whose input width is not a multiple of 128
  // (fp8_gemm's requirement), is bf16 as in kBf16, logged once per tensor name suffix. Routed
  // experts stored FP8 or FP4 (per expert, with scales; hidden and moe_intermediate_size multiples
  // of 128) are FP8 on the device, FP4 converted at load (engine/stored_experts.h), and multiplied
  // by kernels/cuda/moe_gemm (bf16 per-pick outputs, summed in fp32); otherwise bf16 as in kBf16.
  // The embeddings, lm_head and router are as in kBf16. Requires GemmInputs::kBf16.
  kFp8Block,
  // The tensors kFp8Block would keep FP8 (projections stored FP8 with block scales, routed experts
  // stored FP8 / FP4) read the same way, from the mmapped checkpoint (checkpoint_dir), one tensor
  // or one expert at a time, but dequantized on the host (engine/quant.h DequantizeFp8; FP4 experts
  // through the same FP8 conversion as kFp8Block) and held bf16 on the device: kBf16's kernels and
  // numbers (bit for bit where the FP4 -> FP8 conversion is exact, engine/stored_experts.h)
  // without kBf16's float32 host copy of every weight. The reference the FP8 path is measured
  // against at sizes the fp32 host copy cannot load (an 8-layer V4-Flash: 196 GiB). Twice
  // kFp8Block's HBM for the same tensors. The `weights` passed to Create may lack them (as for
  // kFp8Block).
  kBf16Dequantized,
};

// The activations of the products with FP8-stored weights (WeightFormat::kFp8Block: the dense
// projections kept FP8 and the routed experts).
//   kBf16 (W8A16, the default): kept bf16, the weights converted exactly to bf16 in registers
//     (kernels/cuda fp8_gemm_w8a16, ExpertFormat::kFp8W8A16). Reads the same weight bytes as
//     kFp8. On the bundled model FP8-quantized, CPU emulation: 99.8% argmax agreement with the
//     fp32 CPU engine (docs/engine-gpu.md, "FP8 weights").
//   kFp8 (W8A8, as DeepSeek's inference runs): quantized per 1 x 128 to e4m3 on the fly
//     (fp8_gemm, ExpertFormat::kFp8); CPU emulation: 98.1%, below issue 25's 99%.
enum class Fp8Activations {
  kBf16,
  kFp8,
};

// Which rows of a chunk's logits a prompt forward (Forward, ForwardExporting, FinishForward)
// copies to the host (engine/chunk_logits.h): with kLastRow the device still computes every row,
// only the copy and the host tensor shrink.
using ChunkLogits = engine::ChunkLogits;

// The rows the serving paths (runtime/cuda: GpuPrefillEngine, GpuStepRunner's prompt chunks and
// canary recompute, all of which read only the last row) ask of a prompt chunk: kLastRow, unless
// the environment sets PDSERVE_GPU_CHUNK_LOGITS=all (kAllRows: the copy of every row, kept for
// comparison; docs/engine-gpu.md, "Prompt chunks' logits"; =last or another value: kLastRow, the
// other value warned about once). Reads the environment on each call; thread-safe.
ChunkLogits ServingChunkLogits();

struct GpuModelOptions {
  int device = 0;
  int64_t slots = 8;        // requests held at once
  int64_t max_context = 0;  // tokens per request; 0 -> min(max_position_embeddings, 4096)
  int64_t max_chunk = 256;  // tokens per Forward() call
  // Decode batch-size buckets; DecodeStep pads a batch to the smallest bucket >= it. Buckets
  // above `slots` are dropped and `slots` itself is always one; empty: the powers of two below
  // slots, and slots.
  std::vector<int64_t> decode_buckets;
  // Decode steps use the fixed-shape kernels where the model's shapes fit them: sparse decode
  // attention (head_dim 512, heads a multiple of 64) and the lightning indexer (64 heads x 128).
  // false: the any-shape kernels (what guards.reference_kernels "sparse_attention" / "indexer"
  // select once this engine serves; tests compare the two).
  bool fixed_shape_attention = true;
  bool fixed_shape_indexer = true;
  // TEST ONLY (false in every deployment): a deliberately wrong fixed-shape decode indexer, the
  // CUDA engine's PDSERVE_TEST_SCRAMBLE_INDEXER (engine/model_options.h, docs/guards.md). After
  // the lightning indexer scores a decode row it keeps the top_k LOWEST-scoring visible entries
  // instead of the highest (the bug class of a comparator with the wrong sign): a row with at
  // most index_topk visible entries selects all of them either way, so only contexts past
  // index_topk * compress_rate tokens (2048 on V4 shapes) attend to other entries. Only where the
  // fixed-shape indexer runs (decode steps, fixed_shape_indexer, V4 indexer shapes); Forward
  // (prefill) and the any-shape indexer stay correct, which is what the canary's recompute and
  // guards.reference_kernels [indexer] rely on.
  bool test_lowest_score_indexer = false;
  // TEST ONLY (false in every deployment): the other wrong fixed-shape decode indexer,
  // engine::IndexerFault::kUnmaskedSlots: after the top-k, a row's slots past its visible entries
  // hold their slot numbers instead of -1, so decode attention gathers entries that do not exist
  // yet (never-written page rows: the fresh pool's NaN, or a freed page's stale rows). Only rows
  // with fewer than index_topk visible entries change (contexts below 2048 tokens on V4 shapes).
  bool test_unmasked_indexer = false;
  GemmInputs gemm_inputs = GemmInputs::kBf16;
  WeightFormat weight_format = WeightFormat::kBf16;
  Fp8Activations fp8_activations = Fp8Activations::kBf16;  // used with kFp8Block only
  // kFp8Block: the model directory whose checkpoint (model.safetensors or sharded with an index)
  // holds the FP8 tensors; the `weights` passed to Create may then lack them
  // (engine::WeightsLoadOptions::skip_fp8_matrices, skip_quantized_experts), the rest must be
  // there.
  std::string checkpoint_dir;
  // Expert parallelism: this model is rank expert_comm->rank() of expert_comm->world() and holds
  // routed experts ExpertShardOf(n_routed_experts, world, rank) only. Not owned; must outlive the
  // model; its device must be `device`. A communicator that cannot be captured into CUDA graphs
  // (the local one) makes DecodeStep eager whatever use_graph says. Null: every expert here.
  ExpertComm* expert_comm = nullptr;
  // Paged state. paged_state false: the slot layout (slot s always names the same pages, as if
  // every slot were full; a reference for tests, bit-identical results). state_tokens: the
  // tokens of state the page pools hold over all requests together; each compression rate r's
  // pool gets ceil(state_tokens / r / kPageSize) pages plus one per slot (a request's last page
  // is partly filled), at most slots full ones. 0: slots * max_context, every slot full (the
  // pools are never short). Below that, Forward / DecodeStep return ResourceExhausted when the
  // pool cannot hold a step (CanHold answers first).
  bool paged_state = true;
  int64_t state_tokens = 0;
  // Fused projections (engine/fused_projections.h; issue 25's decode GEMMs): per layer, the
  // projections of the attention input (q_a, kv, the compressors' kv / gate, the indexer's
  // weights_proj) stacked into one weight and run as one GEMM, the shared expert's gate and up
  // likewise, and FP8 o_a's groups as one grouped GEMM (kernels/cuda/moe_gemm.cuh) at decode
  // sizes instead of one call per group. The parts become views into the stacked weight (no
  // second copy in HBM); a group whose parts mix FP8 and bf16 stays unfused. Off with
  // GemmInputs::kFp32. PDSERVE_FUSED_PROJECTIONS=0 / =1 in the environment overrides this field
  // for every model of the process. On by default since its H200 run of 2026-12-04 (decode steps
  // 2-9% faster, logits as unfused: docs/engine-gpu.md, "Fused projections").
  bool fused_projections = true;
  // W8A8 (WeightFormat::kFp8Block with Fp8Activations::kFp8) at prefill sizes: each bf16 input of
  // the FP8 projections is quantized to e4m3 + scales once, in the kernel that writes it
  // (kernels/cuda/act_quant.cuh: the casts of the normed hidden state, of q_a's output, of the
  // attention output (in o_a's column groups) and of o_a's output; the shared expert's clamped
  // SwiGLU, fused), and every FP8 projection reading
  // it multiplies those rows (kernels/cuda fp8_gemm_quantized) instead of quantizing them again
  // per call. Only where fp8_gemm would take cuBLASLt (rows >= kFp8LtMinTokens, n a multiple of
  // 128): there the logits equal the option's absence bit for bit; elsewhere nothing changes.
  // Two e4m3 buffers and their scales ([max_rows, heads * head_dim] the larger on V4 shapes: 128
  // MiB at 4096 rows on V4-Flash). PDSERVE_FP8_SHARED_ACT_QUANT=1
  // (or 0) in the environment overrides this field for every model of the process. Compiled, not
  // yet run on a GPU (2026-12-04): off until tools/gpu/run_actq25.sh has measured it.
  bool fp8_shared_act_quant = false;
  // Fused hyper-connection pre-mix (kernels/cuda/hyper_connection_fused.cuh): each HcPre (two a
  // layer: before attention and before the FFN) runs as two kernels (split-K dot products of the
  // unnormalized streams with hc_*_fn and their sums of squares, then per row the mixing weights,
  // Sinkhorn, collapse and the sublayer's RMSNorm) instead of rms_norm + the fp32 GEMM (cuBLAS,
  // 1-3 launches) + hyper_connection_pre (2) + rms_norm. The same math rounded differently (the
  // normalization applied after the dot products). Any row count (prefill chunks too); shapes the
  // kernels do not take (hc_mult > 4, hidden > 8192) keep the unfused path. Its workspace is the
  // unfused path's `flat` buffer, so no memory is added. PDSERVE_FUSED_HC_PRE=1 (or 0) in the
  // environment overrides this field for every model of the process; =pdl is 1 with both kernels
  // launched programmatically (kernels/cuda/grid_dependency.cuh), to compare. Compiled, not yet run
  // on a GPU (2026-12-05): off until tools/gpu/run_hcpre59.sh has measured it.
  bool fused_hc_pre = false;
};

// One compression rate's page pool (GpuModel::StatePages).
struct StatePageKind {
  int64_t rate = 0;          // tokens per entry
  int64_t page_entries = 0;  // entries per page
  int64_t pages_total = 0;   // allocatable pages
  int64_t pages_free = 0;
  int64_t bytes_per_page = 0;  // over every layer of this rate (entries and indexer keys, bf16)
};

// One layer's state blocks of one slot in device memory (GpuModel::SlotLayerBlocks): the ring
// layout of engine/ring_state.h, on the model's device. Not owning; valid until the slot's pages
// change (ResetSlot, a growth by a step, an import, CopySlot).
struct DeviceEntryRun {
  void* data = nullptr;  // bf16 [rows, dim]: entry rows contiguous in the entry pool
  int64_t rows = 0;
};
struct DeviceCompressorBlocks {
  float* ring_kv = nullptr;    // fp32 [2m, width]
  float* ring_gate = nullptr;  // fp32 [2m, width]
  int64_t dim = 0;             // entry row width (bf16 values)
  // Entry rows 0 .. count - 1 in order, as runs (the slot's entry pages, merged where adjacent).
  std::vector<DeviceEntryRun> entries;
  // The rows after the last run up to the end of its entry page (what an import sets to NaN).
  void* tail = nullptr;
  int64_t tail_rows = 0;
  bool present() const { return ring_kv != nullptr; }
};
struct DeviceLayerBlocks {
  void* window = nullptr;  // bf16 [W, hd]
  DeviceCompressorBlocks compressor;
  DeviceCompressorBlocks indexer;  // CSA layers only
};

class GpuModel {
 public:
  // Uploads `weights` (validated by the CPU engine's ValidateWeights rules: pass weights a
  // Model::FromWeights accepted) and allocates the slot pools and workspaces on options.device.
  // FailedPrecondition when no CUDA device is present; InvalidArgument for bad options (a bucket
  // larger than slots, max_context above max_position_embeddings); Internal for CUDA / cuBLAS
  // errors.
  static absl::StatusOr<std::unique_ptr<GpuModel>> Create(const ModelConfig& config,
                                                          const Weights& weights,
                                                          GpuModelOptions options = {});
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const;
  int64_t slots() const;
  int64_t max_context() const;
  int64_t max_chunk() const;  // tokens per Forward() call at most
  // The decode batch buckets, ascending (GpuModelOptions::decode_buckets after Create's rules).
  const std::vector<int64_t>& decode_buckets() const;
  int64_t rank() const;   // 0 without expert parallelism
  int64_t world() const;  // 1 without expert parallelism
  // The stream (a cudaStream_t) the model enqueues its work on, for a caller's own timing events
  // (benchmarks); work the caller enqueues there runs in order with the model's.
  void* cuda_stream() const;
  // Whether HcPre runs fused (GpuModelOptions::fused_hc_pre or PDSERVE_FUSED_HC_PRE, and a shape
  // the fused kernels take).
  bool fused_hc_pre() const;
  // An empty state (position 0) in the CPU engine's layout, as engine::Model::NewState() gives
  // for this model: what runtime::PagedState::Load fills before ImportState.
  ModelState NewState() const;

  // Clears slot `slot` (position 0) for a new request and frees its state pages. InvalidArgument
  // for a bad slot.
  absl::Status ResetSlot(int64_t slot);
  // The can-allocate query of the paged state: whether every (slot, position) pair can hold its
  // position at once (pages the slot holds count), i.e. whether a step taking those slots there
  // would find its pages. False for a bad slot or a position past max_context.
  bool CanHold(const std::vector<std::pair<int64_t, int64_t>>& slot_positions) const;
  // The page pools, one per compression rate (empty for a model of sliding layers only).
  std::vector<StatePageKind> StatePages() const;
  // Paranoid mode (guards.paranoid): every state page slot `slot`'s page tables name is the page
  // the allocator handed the slot's current request, at the same epoch (host side, before a step
  // is launched). FailedPrecondition naming the slot and page otherwise; InvalidArgument for a
  // bad slot.
  absl::Status VerifySlotPages(int64_t slot) const;
  // Test fault for the isolation tests: slot `victim`'s first page of a rate both slots hold
  // becomes `donor`'s (its table row on the device and its record), as an allocator bug would
  // hand a page to the wrong request. FailedPrecondition when the slots share no such page or the
  // state is not paged.
  absl::Status InjectForeignPageForTest(int64_t victim, int64_t donor);
  // Test fault: the next `calls` selections of the model's device (every public call's first
  // step) fail with Internal, as cudaSetDevice on a lost device would.
  void FailDeviceSelectionForTest(int64_t calls);
  // Tokens consumed by the slot's request so far.
  int64_t Position(int64_t slot) const;
  // Makes slot `to` continue exactly where slot `from` is (its whole state and position), e.g.
  // to fork one prefilled prompt into n choices. InvalidArgument for bad or equal slots;
  // ResourceExhausted (slot `to` then empty) when the page pool cannot hold a second copy;
  // Internal for a CUDA error.
  absl::Status CopySlot(int64_t from, int64_t to);

  // Device addresses of layer `layer`'s blocks of slot `slot` for a state at `position` tokens
  // (entry rows 0 .. position / m - 1 of each compressor): what runtime/cuda/device_state_pages
  // copies device to device, as ExportLayerAsync and EnqueueStagedLayer copy through pinned
  // memory. Touches no memory and enqueues nothing: a caller reading the blocks orders its
  // stream after the work that wrote them (the model's stream, cuda_stream()), and one writing
  // them does so inside a staged import (EnqueueStagedLayerOnDevice). InvalidArgument for a bad
  // slot or layer, a position outside [0, max_context], or entry rows the slot holds no pages
  // for (a slot is given its pages by a step to that position or BeginStagedImport); Internal
  // for a block of another layout. Thread-safety: as every GpuModel call.
  absl::StatusOr<DeviceLayerBlocks> SlotLayerBlocks(int64_t slot, int64_t layer, int64_t position);

  // The request state of slot `slot` in the CPU engine's layout (engine/state.h) at position
  // Position(slot): window_kv [min(p, W-1), hd], each compressor's buffer_kv / buffer_gate
  // [p % m, width], overlap_kv / overlap_gate [m, dim] (CSA and indexer once p >= m, else
  // [0, dim]), entries [p / m, dim]; empty compressor fields where the layer has none. Host
  // float32: the window rows, compressed entries and indexer keys are the device's bf16 values
  // exactly, the compressor buffers and overlaps its fp32 values. The mapping is
  // engine/ring_state.h. A CPU engine with this model's weights continues the sequence from it
  // (up to the two engines' arithmetic), as does ImportState on any GpuModel of the same model.
  // InvalidArgument for a bad slot; Internal for a CUDA error. Synchronizes the stream: one
  // blocking transfer of the whole slot (entry blocks at full capacity) through pageable memory.
  // The prefill worker exports layer by layer instead (ExportLayerAsync); this stays the simple
  // whole-state export and the reference that path is tested against.
  absl::StatusOr<ModelState> ExportState(int64_t slot);

  // Pinned bytes of one StateStaging layer buffer: the largest layer's blocks at max_context.
  size_t StagingLayerBytes() const;
  // A staging of `buffers` layer buffers (buffers x StagingLayerBytes() pinned bytes, allocated
  // here once) for ExportLayerAsync on this model; it must not outlive the model.
  // InvalidArgument for buffers outside [1, layers]; Internal for a CUDA error.
  absl::StatusOr<std::unique_ptr<StateStaging>> NewStateStaging(int64_t buffers) const;
  // Enqueues the device-to-host copies of layer `layer` of slot `slot` at its current position
  // into `staging` (the layer's buffer, layer % buffers) on the model's stream, after the work
  // already enqueued there, records the buffer's event and returns without waiting; then
  // StateStaging::TakeLayer(layer) waits for that layer only and gives its CPU-layout state,
  // bit for bit ExportState's layer. Copies of several layers run in the order enqueued, so the
  // host can take layer L while later layers are still copying. Later calls on this model are
  // ordered after the copies on the same stream, so a copy sees the slot as it was when it was
  // enqueued even if the slot runs on meanwhile. InvalidArgument for a bad slot or layer or a
  // staging of another model; FailedPrecondition when the layer's buffer still holds a layer not
  // taken; Internal for a CUDA error. Between BeginForwardExporting and FinishForward the copy
  // runs on the copy stream instead, after the chunk's attention of that layer (see there);
  // work enqueued after FinishForward is ordered after it all the same.
  absl::Status ExportLayerAsync(int64_t slot, int64_t layer, StateStaging* staging);
  // Makes slot `slot` hold `state` (any CPU-layout state: from the CPU engine, from ExportState
  // of this or another GpuModel of the same model, or loaded from state-pool pages), so the next
  // Forward / DecodeStep continues at state.position. Window rows, entries and indexer keys are
  // rounded to bf16 (round to nearest even) as the device stores them; the compressor buffers and
  // overlaps stay fp32, exact. The rows the next forward does not read are set to NaN, as a fresh
  // pool's. ExportState then ImportState reproduces a slot bit for bit. InvalidArgument, slot
  // untouched, for a bad slot or a state whose shapes do not match this model at state.position
  // (engine::ValidateRingState: layer count, rows and columns of every field) or whose position
  // exceeds max_context; Internal for a CUDA error (the slot's contents are then undefined until
  // ResetSlot or a successful import). Synchronizes the stream.
  absl::Status ImportState(int64_t slot, const ModelState& state);
  // The same import through `staging`'s pinned layer buffers (a staging of this model holding no
  // exported layer): layer L is converted into buffer L % buffers and its host-to-device copies
  // are enqueued while the host converts the layers after it, so the copies overlap the
  // conversion and run at pinned speed; of the entry blocks only the p / m rows written are
  // converted and copied, the rest is set on the device to the fresh pool's NaN (all bits set).
  // Same result bit for bit on every row a forward reads (the unread rows are NaN either way, with
  // another NaN payload in the entry blocks), same errors; FailedPrecondition
  // when a buffer still holds an exported layer. Synchronizes the stream; on return every
  // buffer is free again.
  absl::Status ImportState(int64_t slot, const ModelState& state, StateStaging* staging);

  // Writes layer `layer`'s blocks at the import's position into host memory (`blocks`, a pinned
  // staging buffer laid out for `geometry`, this model's layer): the rows a forward reads of the
  // window ring (bf16 bits) and both compressors' rings (fp32), and entry rows
  // 0 .. position / m - 1 (bf16 bits). Every other ring row already holds the fresh pool's NaN
  // and may be left alone. A non-OK status stops the import.
  using LayerImageFill = gpu::LayerImageFill;
  // Makes slot `slot` hold a state at `position` whose layers `fill` writes, layer by layer,
  // into `staging`'s pinned buffers, each layer's host-to-device copies enqueued while `fill`
  // writes the next (no CPU-layout ModelState in between: runtime::PagedState::LoadLayerRing
  // fills straight from bf16 or fp32 state pages). ImportState(slot, state, staging) is this with
  // a fill that converts `state`, so the two give the same slot bit for bit for the same rows.
  // InvalidArgument, slot untouched, for a bad slot, a staging of another model or a position
  // outside [0, max_context]; FailedPrecondition when a buffer still holds an exported layer;
  // `fill`'s error or Internal for a CUDA error, the slot then reset (no partial state is left).
  // Synchronizes the stream; on return every buffer is free again.
  absl::Status ImportLayers(int64_t slot, int64_t position, StateStaging* staging,
                            const LayerImageFill& fill);

  // The staged import (the PD decode's early import, runtime/early_import.h): ImportLayers cut
  // into calls a receiver can make as each layer's pages arrive, in any layer order, while the
  // model runs steps of other slots. BeginStagedImport takes the slot's state pages for
  // `position` (ResetSlot, then the pages) and leaves the slot unreadable (Position 0) until
  // FinishStagedImport; for each layer, StateStaging::FillImportLayer (host only, no model state)
  // writes the layer into a free pinned buffer, then
  // EnqueueStagedLayer enqueues its host-to-device copies on the model's import stream (a stream
  // of its own, ordered after everything enqueued on the model's stream before
  // BeginStagedImport; the steps of other slots never wait for it) and records the buffer's
  // event. StagedImportCopied says, without waiting, whether every layer was enqueued and its
  // copies have landed; FinishStagedImport (every layer enqueued) orders the model's stream after
  // the copies and sets the slot's position: the slot then holds what ImportLayers(slot,
  // position, ..) with the same fills gives, bit for bit. CancelStagedImport waits for the copies
  // in flight and resets the slot (its pages back), the pages going back even when its device
  // calls fail (it then returns their error). Errors: InvalidArgument for a bad slot,
  // layer, position or a staging of another model; FailedPrecondition for a Begin on a slot
  // already importing, an Enqueue / Finish / Copied without a Begin, a layer enqueued twice or
  // not filled in `staging`, a Finish before every layer was enqueued; Internal for a CUDA error
  // (the caller then cancels). Thread-safety: as every GpuModel call, one thread at a time: a
  // caller that imports on another thread than its step loop serializes these calls with the
  // steps (runtime::GpuStepRunner holds its model mutex around both); FillImportLayer touches
  // only the staging and may run concurrently with any call on the model.
  absl::Status BeginStagedImport(int64_t slot, int64_t position);
  absl::Status EnqueueStagedLayer(int64_t slot, int64_t layer, StateStaging* staging);
  // EnqueueStagedLayer for a layer whose bytes are already in device memory (state pages in a
  // device arena, a peer's mapped through CUDA IPC: runtime/cuda/device_state_pages.h): no
  // staging; on the import stream, every byte of the slot's window and ring blocks of the layer
  // and the entry tail of its last entry pages are set to all bits one (NaN, as a fresh pool's:
  // the rows a forward does not read), then `enqueue(blocks, position, stream)` is called once
  // with SlotLayerBlocks(slot, layer, position), the import's position and the import stream (a
  // cudaStream_t) to enqueue its device-to-device copies of the rows a forward reads there,
  // without waiting.
  // Bookkeeping and errors as EnqueueStagedLayer's (the staging's excepted), plus `enqueue`'s
  // error (the layer then counts as not enqueued; the caller cancels).
  using DeviceLayerEnqueue =
      std::function<absl::Status(const DeviceLayerBlocks& blocks, int64_t position, void* stream)>;
  absl::Status EnqueueStagedLayerOnDevice(int64_t slot, int64_t layer,
                                          const DeviceLayerEnqueue& enqueue);
  // EnqueueStagedLayerOnDevice with the all-bits-one fill left to the caller: `enqueue` also
  // gets the byte ranges to fill (`fills`, device memory of the slot) and must have them filled
  // on `stream` before its copies land over them, by the time the layer counts as enqueued for
  // the import's last layer (its completion event is recorded when that call returns), so a
  // caller may batch every layer's fills and copies into a few launches made in the last layer's
  // call (DeviceStatePages::ImportSlotBatched). Same bookkeeping and errors.
  struct DeviceFill {
    void* to = nullptr;
    int64_t bytes = 0;
  };
  using DeviceLayerEnqueueFills =
      std::function<absl::Status(const DeviceLayerBlocks& blocks, int64_t position,
                                 const std::vector<DeviceFill>& fills, void* stream)>;
  absl::Status EnqueueStagedLayerOnDeviceFills(int64_t slot, int64_t layer,
                                               const DeviceLayerEnqueueFills& enqueue);
  absl::StatusOr<bool> StagedImportCopied(int64_t slot);
  absl::Status FinishStagedImport(int64_t slot);
  absl::Status CancelStagedImport(int64_t slot);

  // Extends slot `slot` by `tokens` (1 .. max_chunk ids at positions Position(slot) onward) and
  // returns their logits, fp32 [tokens.size(), vocab_size] on the host. group_rows > tokens.size()
  // pads the call to that many rows (a lock-step call of an expert-parallel group; the padding
  // rows write only a scratch slot and their logits are dropped). InvalidArgument (state
  // untouched) for an empty or too long chunk, group_rows above max(max_chunk, the largest
  // bucket), a bad id or slot, or a context past max_context.
  // rows = ChunkLogits::kLastRow: only the chunk's last token's logits come back, [1,
  // vocab_size] (the device computes every row all the same; only the copy to the host shrinks).
  absl::StatusOr<Tensor> Forward(int64_t slot, const std::vector<int32_t>& tokens,
                                 int64_t group_rows = 0, ChunkLogits rows = ChunkLogits::kAllRows);
  // Forward that also exports the slot's state as it becomes final, for a prompt's last chunk:
  // right after layer l's attention (which writes all of l's state) is enqueued, for the first
  // min(staging->buffers(), layers) layers, the device-to-host copies of layer l at the slot's
  // position after this call are enqueued on a second stream that waits for that point, as
  // ExportLayerAsync(slot, l, staging) would enqueue them after the whole forward. So layer l's
  // copy runs while layers l + 1 .. compute, and StateStaging::TakeLayerBlocks(l) takes it as
  // usual (then export the remaining layers with ExportLayerAsync; a layer already held need
  // not be exported again). Errors as Forward; InvalidArgument for a staging of another model;
  // FailedPrecondition when one of those layers' buffers still holds a layer. On an error the
  // staging may hold some of the copies: Discard it.
  absl::StatusOr<Tensor> ForwardExporting(int64_t slot, const std::vector<int32_t>& tokens,
                                          StateStaging* staging,
                                          ChunkLogits rows = ChunkLogits::kAllRows);
  // ForwardExporting in two halves, so the calling thread can store and send the exported layers
  // while the later layers compute: BeginForwardExporting checks and enqueues the chunk (with the
  // per-layer copies) and returns without waiting; FinishForward waits for it and returns its
  // logits. In between, on the same thread, only StateStaging::TakeLayerBlocks and
  // ExportLayerAsync may be called on this model and its staging; such an ExportLayerAsync of
  // the chunk's slot copies the layer at the slot's new position as soon as the chunk's
  // attention of that layer is done (on the copy stream), not after the whole chunk, so a
  // staging with fewer buffers than layers still overlaps every layer whose buffer the host frees
  // in time. FinishForward must follow, also after an error. Errors as ForwardExporting's;
  // FailedPrecondition for a Begin while one is pending or a Finish without one.
  absl::Status BeginForwardExporting(int64_t slot, const std::vector<int32_t>& tokens,
                                     StateStaging* staging,
                                     ChunkLogits rows = ChunkLogits::kAllRows);
  absl::StatusOr<Tensor> FinishForward();
  // BeginForwardExporting for state pages in device memory (runtime/cuda/device_state_pages.h,
  // the same-host device-to-device path): right after each layer l's attention (which writes
  // all of l's state) is enqueued, `layer_final(l, position, stream)` is called on this thread
  // with the slot's position after this call and the model's copy stream (a cudaStream_t),
  // which then waits for that point: what the caller enqueues there (the layer's gather into
  // device pages and their checksums: DeviceStatePages::StoreLayer) runs while layers l + 1 ..
  // compute. FinishForward must follow, also after an error; it orders the model's stream after
  // the copy stream, so work enqueued after it sees the gathers done. Errors as Forward's, and
  // `layer_final`'s (the chunk's later layers are then not enqueued: reset the slot).
  using LayerFinal = std::function<absl::Status(int64_t layer, int64_t position, void* stream)>;
  absl::Status BeginForwardStoring(int64_t slot, const std::vector<int32_t>& tokens,
                                   const LayerFinal& layer_final,
                                   ChunkLogits rows = ChunkLogits::kAllRows);

  // One decode token for each of `slots` (distinct) with `tokens[i]` for slots[i]; returns
  // logits [slots.size(), vocab_size]. The batch runs padded to the smallest bucket holding
  // max(slots.size(), group_rows); `slots` may be empty when group_rows > 0 (a rank of a group
  // with nothing to decode this step). use_graph: replay the bucket's CUDA graph (captured on
  // first use); else launch the same kernels eagerly. Errors as Forward.
  absl::StatusOr<Tensor> DecodeStep(const std::vector<int64_t>& slots,
                                    const std::vector<int32_t>& tokens, bool use_graph,
                                    int64_t group_rows = 0);

  // Where DecodeStepOnDevice leaves a step's logits: fp32 [rows, stride] in device memory (row i
  // is slots[i]'s), valid until the next Forward / DecodeStep / DecodeStepOnDevice / Idle of this
  // model, and the stream (a cudaStream_t) the step was enqueued on.
  struct DeviceLogits {
    const float* data = nullptr;
    int64_t rows = 0;
    int64_t stride = 0;
    void* stream = nullptr;
  };
  // As DecodeStep, but the logits stay on the device and, on one GPU (world() == 1), nothing is
  // synchronized: the caller enqueues its use of them on `stream` (runtime::GpuSampler) and
  // synchronizes, and errors of the step's kernels surface there. In an expert-parallel group
  // the step still synchronizes (its communicator's host barrier). Errors as DecodeStep's.
  absl::StatusOr<DeviceLogits> DecodeStepOnDevice(const std::vector<int64_t>& slots,
                                                  const std::vector<int32_t>& tokens,
                                                  bool use_graph, int64_t group_rows = 0);

  // Runs the forward pass over `rows` padding rows only (eagerly): how a rank of an
  // expert-parallel group with no work takes part in a lock-step Forward of the others. Touches
  // only the scratch slot. InvalidArgument for rows outside [1, max(max_chunk, the largest
  // bucket)]; Internal for CUDA errors; Aborted when the group was aborted.
  absl::Status Idle(int64_t rows);

 private:
  struct Impl;
  explicit GpuModel(std::unique_ptr<Impl> impl);
  // Forward's checks and its enqueued work, not waited for (FinishForward waits).
  absl::Status BeginForward(int64_t slot, const std::vector<int32_t>& tokens, int64_t group_rows,
                            ChunkLogits rows);
  // BeginForward with every layer's attention marked (Impl::layer_attended, on the model's
  // stream) and then `marked(layer, position after the call)` called, for BeginForwardExporting
  // and BeginForwardStoring (which check their own arguments first); attended_slot set.
  absl::Status BeginForwardMarked(
      int64_t slot, const std::vector<int32_t>& tokens, ChunkLogits rows,
      const std::function<absl::Status(int64_t layer, int64_t position)>& marked);
  // ExportLayerAsync's copies of layer `layer` at slot position `position`, enqueued on the
  // model's stream or (on_copy_stream) on its copy stream. Checks as ExportLayerAsync's.
  absl::Status ExportLayer(int64_t slot, int64_t layer, StateStaging* staging, int64_t position,
                           bool on_copy_stream);
  // ImportLayers' checks of the target: slot and position ranges, the device blocks' layout
  // (before anything is touched); makes the model's device current.
  absl::Status CheckImport(int64_t slot, int64_t position);
  // ImportLayers' host-to-device copies of layer `layer`'s blocks from the pinned buffer at
  // `base` into slot `slot` at `position`, with the fresh pool's NaN in the unwritten rows of
  // its last entry page, enqueued on `stream` (a cudaStream_t); adds the bytes to *copied.
  absl::Status EnqueueImportCopies(int64_t slot, int64_t position, int64_t layer,
                                   const unsigned char* base, void* stream, size_t* copied);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::engine::gpu
