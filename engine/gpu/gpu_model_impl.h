// Internals of the GPU engine (engine/gpu/gpu_model.h) shared by its two sources:
// gpu_model_load.cc (weights upload, pools, workspaces) and gpu_model.cc (the forward pass).
// Not a public interface. Not thread-safe, as GpuModel.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/expert_parallel.h"
#include "engine/fused_projections.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/ops.cuh"
#include "engine/gpu_workspace_plan.h"  // kOaGroupedMaxRows
#include "engine/ring_state.h"
#include "engine/rope_table.h"
#include "engine/stored_experts.h"
#include "engine/stored_fp8.h"
#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/compressor.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/hyper_connection.cuh"
#include "kernels/cuda/hyper_connection_fused.cuh"
#include "kernels/cuda/indexer.cuh"
#include "kernels/cuda/indexer_generic.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/rms_norm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/sink_attention.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/topk.cuh"
#include "serving/slot_page_tables.h"

namespace pdserve::engine::gpu {

namespace kc = ::pdserve::kernels::cuda;
using bf16 = __nv_bfloat16;

constexpr int64_t kPageSize = 64;

// options.fused_projections unless PDSERVE_FUSED_PROJECTIONS is 0 or 1 in the environment; false
// with GemmInputs::kFp32 (the fp32 reference path keeps its one-GEMM-per-projection form).
bool FusedProjectionsWanted(const GpuModelOptions& options);

// PDSERVE_FUSED_HC_PRE: unset, the option (GpuModelOptions::fused_hc_pre) decides; 0 off; 1 on;
// pdl on with programmatic launches. Another value is warned about once and ignored (kOption).
enum class HcPreSwitch { kOption, kOff, kOn, kPdl };
HcPreSwitch HcPreSwitchFromEnv();
// Whether HcPre runs fused, shapes permitting: options.fused_hc_pre unless `forced` says.
bool FusedHcPreWanted(const GpuModelOptions& options, HcPreSwitch forced);

inline absl::Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLAS status ", static_cast<int>(s)));
}

#define PDSERVE_CUBLAS_RETURN(expr) \
  PDSERVE_RETURN_IF_ERROR(::pdserve::engine::gpu::CublasStatus((expr), #expr))

inline std::vector<bf16> ToBf16(const Tensor& t) {
  std::vector<bf16> out(t.data.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = __float2bfloat16_rn(t.data[i]);
  return out;
}

inline absl::Status UploadBf16(const Tensor& t, DeviceArray<bf16>* d) {
  return d->Upload(ToBf16(t));
}

// Entries [first, first + count) of t's first dimension (an expert-parallel rank's experts),
// rounded to bf16 on the device. The rounding of a large block (a V4-Flash layer's experts are
// 6.4 G values) is split over the host's cores; each value's rounding is the same either way.
inline absl::Status UploadBf16Rows(const Tensor& t, int64_t first, int64_t count,
                                   DeviceArray<bf16>* d) {
  const auto per = static_cast<size_t>(t.numel() / t.dim(0));
  std::vector<bf16> out(static_cast<size_t>(count) * per);
  const float* from = t.data.data() + static_cast<size_t>(first) * per;
  auto round = [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) out[i] = __float2bfloat16_rn(from[i]);
  };
  const size_t n = out.size();
  const size_t parts =
      n < (size_t{1} << 24) ? 1 : std::max<size_t>(1, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (size_t p = 1; p < parts; ++p) pool.emplace_back(round, n * p / parts, n * (p + 1) / parts);
  round(0, n / parts);
  for (std::thread& th : pool) th.join();
  return d->Upload(out);
}
// A projection weight [out, in]: bf16 on the device, or (GemmInputs::kFp32) the same
// bf16-rounded values held as fp32 for SGEMM, or (WeightFormat::kFp8Block, stored so) the
// checkpoint's e4m3 bytes [out, in] with fp32 scales [ceil(out / 128), in / 128].
// A part of a fused group (GpuModelOptions::fused_projections) owns nothing: its rows are a view
// into the group's stacked weight (the *_view pointers), whose GEMM writes the part's outputs at
// column fused_col of the group's output rows.
struct Linear {
  DeviceArray<bf16> bf;
  DeviceArray<float> f32;
  DeviceArray<uint8_t> fp8;
  DeviceArray<float> fp8_scale;
  const bf16* bf_view = nullptr;
  const uint8_t* fp8_view = nullptr;
  const float* fp8_scale_view = nullptr;
  int64_t fused_col = -1;  // >= 0: a part of its layer's fused group
  int64_t out = 0;
  int64_t in = 0;
  bool is_fp8() const { return fp8.size() > 0 || fp8_view != nullptr; }
  bool fused() const { return fused_col >= 0; }
  const bf16* bf_weight() const { return bf_view != nullptr ? bf_view : bf.get(); }
  const uint8_t* fp8_weight() const { return fp8_view != nullptr ? fp8_view : fp8.get(); }
  const float* fp8_scales() const {
    return fp8_scale_view != nullptr ? fp8_scale_view : fp8_scale.get();
  }
};

inline absl::Status UploadLinear(const Tensor& t, bool fp32, Linear* d) {
  if (!fp32) return d->bf.Upload(ToBf16(t));
  std::vector<float> rounded(t.data.size());
  for (size_t i = 0; i < rounded.size(); ++i) {
    rounded[i] = __bfloat162float(__float2bfloat16_rn(t.data[i]));
  }
  return d->f32.Upload(rounded);
}

// "model.layers.12.self_attn.q_a_proj.weight" -> "self_attn.q_a_proj.weight": one log line per
// projection kind, not per layer.
inline std::string WithoutLayer(const std::string& name) {
  const size_t at = name.find("layers.");
  if (at == std::string::npos) return name;
  const size_t dot = name.find('.', at + 7);
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

inline absl::Status UploadF32(const Tensor& t, DeviceArray<float>* d) { return d->Upload(t.data); }

// Where the projections come from: the host's fp32 engine::Weights, or (WeightFormat::kFp8Block)
// the checkpoint's stored FP8 matrices first (engine/gpu/gpu_model_load.cc).
struct LinearSource {
  const Weights* weights = nullptr;
  bool fp32 = false;
  const StoredFp8Weights* fp8 = nullptr;
  // Each projection kind (the name without its layer number) falling back to bf16, logged once.
  std::set<std::string>* logged = nullptr;
  // WeightFormat::kBf16Dequantized: every projection `fp8` holds is dequantized to bf16.
  bool dequantize = false;
  // row_group > 0: the projection runs as blocks of row_group rows (o_a's groups), which FP8
  // needs to be whole 128-row scale blocks.
  absl::Status Load(const std::string& name, Linear* d, int64_t row_group = 0) const;
  // The projections of `spec` stacked into `group` (engine/fused_projections.h), each of
  // `parts` (one per name) made a view into it: all FP8 (each stored FP8 with block scales and an
  // input width a multiple of 128, as Load would keep it) or all bf16. false, nothing loaded,
  // when the parts differ (a mix Load would keep partly FP8): the caller loads them one by one.
  absl::StatusOr<bool> LoadFused(const FusedGroupSpec& spec, const std::vector<Linear*>& parts,
                                 Linear* group) const;
};

// One projection of the rank's routed experts kept FP8 (WeightFormat::kFp8Block with the experts
// stored FP8 or FP4; engine/stored_experts.h): w [count, n, k] e4m3, scale [count, ceil(n / 128),
// k / 128] fp32, for kernels/cuda/moe_gemm.
struct ExpertsFp8 {
  DeviceArray<uint8_t> w;
  DeviceArray<float> scale;
  int64_t count = 0;
  int64_t n = 0;
  int64_t k = 0;
  // kFp8 (W8A8) or kFp8W8A16 (GpuModelOptions::fp8_activations).
  kc::ExpertFormat format = kc::ExpertFormat::kFp8;
  bool present() const { return w.size() > 0; }
  kc::ExpertWeights View() const {
    kc::ExpertWeights v;
    v.format = format;
    v.w = w.get();
    v.scale = scale.get();
    v.n_experts = count;
    v.n = n;
    v.k = k;
    return v;
  }
};

inline std::string AttnPrefix(int64_t l) { return absl::StrCat("model.layers.", l, ".self_attn"); }

struct CompressorWeights {
  Linear kv_proj;
  Linear gate_proj;
  DeviceArray<float> position_bias;
  DeviceArray<float> kv_norm;
  int64_t dim = 0;
  int64_t rate = 0;
  bool overlapping = false;
  int64_t width() const { return overlapping ? 2 * dim : dim; }
  // State: the compressor rings per slot, [slots + 1, 2m, width] fp32; the entries paged,
  // [device pages, kPageSize, dim] bf16 (page 0 the null page), through the page tables of
  // `kind` (Impl::pages, one kind per compression rate).
  DeviceArray<float> ring_kv;
  DeviceArray<float> ring_gate;
  DeviceArray<bf16> entries;
  int64_t capacity = 0;  // entries per request at most (a multiple of kPageSize)
  int64_t kind = -1;

  // device_pages: the entry pool's pages (SlotPageTables::device_pages of the rate's kind).
  // fused: kv_proj and gate_proj are already parts of the layer's fused group.
  absl::Status Load(const LinearSource& src, const std::string& prefix, int64_t d, int64_t m,
                    bool overlap, int64_t slots, int64_t max_context, int64_t page_kind,
                    int64_t device_pages, bool fused) {
    const Weights& w = *src.weights;
    dim = d;
    rate = m;
    overlapping = overlap;
    if (!fused) {
      PDSERVE_RETURN_IF_ERROR(src.Load(prefix + ".kv_proj.weight", &kv_proj));
      PDSERVE_RETURN_IF_ERROR(src.Load(prefix + ".gate_proj.weight", &gate_proj));
    }
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(prefix + ".position_bias"), &position_bias));
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(prefix + ".kv_norm.weight"), &kv_norm));
    // Whole pages of kPageSize entries: the fixed-shape decode kernels read the pool as pages.
    capacity = RingEntryCapacity(max_context, m, kPageSize);
    kind = page_kind;
    const auto s = static_cast<size_t>(slots);
    PDSERVE_RETURN_IF_ERROR(ring_kv.Allocate(s * 2 * m * width()));
    PDSERVE_RETURN_IF_ERROR(ring_gate.Allocate(s * 2 * m * width()));
    return entries.Allocate(static_cast<size_t>(device_pages * kPageSize * dim));
  }
};

struct HcWeights {
  DeviceArray<float> fn;
  DeviceArray<float> base;
  DeviceArray<float> scale;
  int64_t outputs = 0;
  absl::Status Load(const Weights& w, const std::string& prefix, const char* fn_name,
                    const char* base_name, const char* scale_name) {
    const Tensor& f = w.At(prefix + fn_name);
    outputs = f.dim(0);
    PDSERVE_RETURN_IF_ERROR(UploadF32(f, &fn));
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(prefix + base_name), &base));
    return UploadF32(w.At(prefix + scale_name), &scale);
  }
};

struct Layer {
  LayerType type = LayerType::kSlidingAttention;
  const RopeTable* rope = nullptr;
  const DeviceArray<float>* inv_freq = nullptr;
  HcWeights attn_hc;
  HcWeights ffn_hc;
  DeviceArray<float> input_norm;
  DeviceArray<float> post_attention_norm;
  // Attention.
  Linear q_a_proj;
  DeviceArray<float> q_a_norm;
  Linear q_b_proj;
  Linear kv_proj;
  DeviceArray<float> kv_norm;
  Linear o_a_proj;
  Linear o_b_proj;
  DeviceArray<float> sinks;
  DeviceArray<bf16> window_ring;  // [slots, W, hd]
  bool has_compressor = false;
  CompressorWeights compressor;
  bool has_indexer = false;
  CompressorWeights indexer_compressor;
  Linear indexer_q_b_proj;
  Linear indexer_weights_proj;
  // MoE.
  bool hash = false;
  DeviceArray<float> gate;  // fp32: routing sees the same logits the fp32 CPU engine would
  DeviceArray<float> correction_bias;
  DeviceArray<int32_t> tid2eid;
  DeviceArray<bf16> gate_up;  // the rank's routed experts (all of them without a group)
  DeviceArray<bf16> down;
  ExpertsFp8 gate_up8;  // instead of gate_up / down when the experts stay FP8
  ExpertsFp8 down8;
  Linear shared_gate;
  Linear shared_up;
  Linear shared_down;
  // GpuModelOptions::fused_projections: the stacked weights of the attention-input group (q_a,
  // kv, the compressors' kv / gate, the indexer's weights_proj) and of the FFN-input group (the
  // shared expert's gate and up); out == 0 where the layer's group is not fused.
  Linear attn_in;
  Linear ffn_in;
};

// Per-call metadata, staged in pinned memory and copied to the device before the kernels run.
enum RowField { kToken, kSlot, kPosition, kFirstPosition, kFirstRow, kRowFields };
enum SegField { kSegFirstPosition, kSegTokens, kSegRowOffset, kSegSlot, kSegFields };

// GpuModelOptions::fp8_shared_act_quant: rows of a GEMM input already quantized (e4m3 [rows, k]
// and their scales in kernels/cuda ActScaleLayout::kGemmSplit, in column groups of group_cols:
// kernels/cuda ActGroups); q null: none.
struct QuantizedRows {
  const uint8_t* q = nullptr;
  const float* s = nullptr;
  int64_t rows = 0;
  int64_t k = 0;
  int64_t group_cols = 0;
};

struct GpuModel::Impl {
  ModelConfig config;
  GpuModelOptions options;
  int64_t max_rows = 0;
  int64_t max_context = 0;
  int64_t scratch_slot = 0;             // the extra slot padding rows of a decode bucket write to
  std::vector<int64_t> slot_positions;  // tokens consumed, per slot
  RingGeometry geometry;                // one slot's state layout (ExportState / ImportState)
  RopeTable main_rope;
  RopeTable compress_rope;
  DeviceArray<float> main_inv_freq;
  DeviceArray<float> compress_inv_freq;
  cudaStream_t stream = nullptr;
  // GpuModel::ForwardExporting's: the stream the per-layer state copies run on, one event per
  // layer marking the end of its attention on `stream`, and the hook Enqueue calls right after
  // each layer's attention (null outside ForwardExporting). Made at the first ForwardExporting.
  cudaStream_t copy_stream = nullptr;
  std::vector<cudaEvent_t> layer_attended;
  std::function<absl::Status(int64_t layer)> after_attention;
  // The slot whose chunk BeginForwardExporting marked layer by layer in layer_attended (-1: none);
  // meaningful while `pending` (until FinishForward).
  int64_t attended_slot = -1;
  cudaEvent_t copies_enqueued = nullptr;  // Finish orders the stream after copy_stream with it
  // Makes copy_stream, copies_enqueued and one layer_attended event per layer (once).
  absl::Status MakeLayerMarks();
  // GpuModel::BeginStagedImport ..: the stream staged imports copy on (made at the first Begin)
  // and, per slot (sized then), the import in progress.
  struct StagedImport {
    bool active = false;
    int64_t position = 0;
    std::vector<char> enqueued;    // per layer
    int64_t left = 0;              // layers not yet enqueued
    cudaEvent_t begun = nullptr;   // on `stream` at Begin: the import stream waits for it
    cudaEvent_t copied = nullptr;  // on import_stream after the last layer's copies
  };
  cudaStream_t import_stream = nullptr;
  std::vector<StagedImport> staged_imports;
  cublasHandle_t cublas = nullptr;
  DeviceArray<unsigned char> cublas_workspace;

  DeviceArray<bf16> embed;
  Linear lm_head;
  DeviceArray<float> final_norm;
  HcWeights head_hc;
  std::vector<Layer> layers;

  // Workspace, sized for max_rows.
  DeviceArray<float> streams, flat, mix, post, comb, collapsed, sub_out;
  DeviceArray<bf16> x_bf;
  DeviceArray<float> q_res, q, kv, attn, grouped;
  DeviceArray<bf16> q_res_bf, new_kv, attn_bf, grouped_bf;
  DeviceArray<float> comp_kv, comp_gate;
  DeviceArray<float> idx_q, idx_w, idx_scores;
  DeviceArray<int32_t> idx_visible, picks;
  DeviceArray<float> sh_gate, sh_up, router_logits, route_weights;
  DeviceArray<bf16> act_bf;
  DeviceArray<int32_t> route_experts;
  DeviceArray<unsigned char> moe_workspace;
  DeviceArray<float> logits;
  // WeightFormat::kFp8Block: fp8_gemm's workspace (its outputs are fp32, written in place).
  DeviceArray<unsigned char> fp8_workspace;
  // GpuModelOptions::fp8_shared_act_quant: two inputs' e4m3 rows and scales
  // (ActScaleLayout::kGemmSplit), slot 0 the normed hidden state or o_a's output, slot 1 q_a's
  // output, the attention output (o_a's column groups) or the shared expert's SwiGLU (live at the
  // same time as slot 0). Empty when the option is off.
  DeviceArray<unsigned char> act_q[2];
  DeviceArray<float> act_s[2];
  // GpuModelOptions::fused_projections (off with GemmInputs::kFp32): a fused group's GEMM output
  // [max_rows, widest group] fp32, and FP8 o_a's groups as one moe_grouped_gemm call: its
  // "expert" ids [max_rows, o_groups] (row r's pick g is group g) and workspace.
  bool fused = false;
  DeviceArray<float> fused_out;
  // GpuModelOptions::fused_hc_pre, where every site's shape allows it (set by
  // EnableFusedHcPre); its partials live in `flat`.
  bool fused_hc_pre = false;
  bool hc_pre_programmatic = false;  // PDSERVE_FUSED_HC_PRE=pdl
  bool o_a_grouped = false;
  DeviceArray<int32_t> o_a_ids;
  DeviceArray<unsigned char> o_a_workspace;
  // FP8 routed experts (Layer::gate_up8): per pick [world * max_rows * k, ...] bf16 gate|up
  // outputs, SwiGLU activations and weighted down outputs, and moe_grouped_gemm's workspace.
  DeviceArray<bf16> moe_gate_up, moe_act, moe_down;
  DeviceArray<unsigned char> moe_gemm_workspace;
  // Fixed-shape decode kernels: their bf16 inputs, paged views and workspace.
  bool fast_attention = false;
  bool fast_indexer = false;
  int sm_count = 0;
  DeviceArray<bf16> q_bf, idx_q_bf;
  DeviceArray<int32_t> window_len, n_compressed, page_table;
  DeviceArray<unsigned char> attn_workspace;
  DeviceArray<int32_t> rows_meta;  // [kRowFields, max_rows]
  DeviceArray<int32_t> seg_meta;   // [kSegFields, max_rows]
  PinnedArray<int32_t> rows_host;
  PinnedArray<int32_t> seg_host;
  PinnedArray<float> logits_host;
  std::map<int64_t, cudaGraphExec_t> graphs;
  // Paged state (serving/slot_page_tables.h): one kind per compression rate; its rows on the
  // device [slots + 1, stride] int32 (what the kernels read), staged through pinned memory; the
  // event marks the last upload, so the pinned rows are rewritten only after it was copied.
  std::unique_ptr<serving::SlotPageTables> pages;
  std::map<int64_t, int64_t> kind_of_rate;
  std::vector<std::unique_ptr<DeviceArray<int32_t>>> slot_pages;
  std::vector<std::unique_ptr<PinnedArray<int32_t>>> slot_pages_host;
  cudaEvent_t pages_uploaded = nullptr;
  // Expert parallelism (options.expert_comm): the rank's experts and the group's stacked rows,
  // [world * max_rows, ...] (rank p's rows at p * rows).
  ExpertComm* comm = nullptr;
  ExpertShard shard;
  DeviceArray<bf16> ep_x;           // [world * max_rows, hidden] gathered MoE inputs
  DeviceArray<int32_t> ep_experts;  // [world * max_rows, k] gathered picks, then local ids
  DeviceArray<float> ep_weights;    // [world * max_rows, k] gathered pick weights
  DeviceArray<float> ep_out;        // [world * max_rows, hidden] this rank's partial sums
  DeviceArray<float> ep_reduced;    // [max_rows, hidden] the group's sums of this rank's rows

  Impl(ModelConfig c, GpuModelOptions o)
      : config(std::move(c)),
        options(std::move(o)),
        main_rope(config.rope_main, config.qk_rope_head_dim, config.max_position_embeddings),
        compress_rope(config.rope_compress, config.qk_rope_head_dim,
                      config.max_position_embeddings) {}
  ~Impl() {
    for (auto& [bucket, exec] : graphs) cudaGraphExecDestroy(exec);
    if (pages_uploaded != nullptr) cudaEventDestroy(pages_uploaded);
    if (cublas != nullptr) cublasDestroy(cublas);
    for (cudaEvent_t e : layer_attended) cudaEventDestroy(e);
    if (copies_enqueued != nullptr) cudaEventDestroy(copies_enqueued);
    if (copy_stream != nullptr) cudaStreamDestroy(copy_stream);
    for (StagedImport& i : staged_imports) {
      if (i.begun != nullptr) cudaEventDestroy(i.begun);
      if (i.copied != nullptr) cudaEventDestroy(i.copied);
    }
    if (import_stream != nullptr) cudaStreamDestroy(import_stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // Makes options.device the calling thread's current device: every public entry point does, so
  // a GpuModel created on one thread may be driven from another (a server's step loop).
  absl::Status UseDevice() const {
    if (use_device_faults > 0) {
      --use_device_faults;
      return absl::InternalError("GpuModel: cudaSetDevice failed (a test fault)");
    }
    return CudaStatus(cudaSetDevice(options.device), "cudaSetDevice");
  }
  // FailDeviceSelectionForTest's count: the next UseDevice calls that fail.
  mutable int64_t use_device_faults = 0;
  const int32_t* Row(RowField f) const { return rows_meta.get() + f * max_rows; }
  const int32_t* Seg(SegField f) const { return seg_meta.get() + f * max_rows; }

  absl::Status Load(const Weights& w);
  // The page tables and their device rows, before Load sizes the entry pools from them.
  absl::Status MakePages();
  // The paged view of cw's entries for the kernels.
  kc::EntryPages EntryPagesOf(const CompressorWeights& cw) const {
    if (cw.kind < 0) return {};
    return {slot_pages[static_cast<size_t>(cw.kind)]->get(), pages->stride(cw.kind), kPageSize};
  }
  const int32_t* SlotPagesOf(const CompressorWeights& cw) const {
    return cw.kind < 0 ? nullptr : slot_pages[static_cast<size_t>(cw.kind)]->get();
  }
  // Grows every (slot, position) target's pages (all or nothing: ResourceExhausted) and enqueues
  // the copies of the changed rows to the device.
  absl::Status GrowPages(const std::vector<std::pair<int64_t, int64_t>>& targets);
  absl::Status UploadPageRows();
  // Entries [0, count) of slot's cw pool as runs of consecutive device rows: (first entry's
  // pointer, entries), in entry order. REQUIRES: the slot holds those entries' pages.
  std::vector<std::pair<bf16*, int64_t>> EntryRuns(CompressorWeights& cw, int64_t slot,
                                                   int64_t count) const;
  // kFp8Block's buffers, sized for the FP8 projections Load kept (nothing without them).
  absl::Status AllocateFp8();
  // out[rows, n] (fp32, row stride out_stride, unrounded) = x[rows, k] (bf16, row stride
  // x_stride) @ W^T for FP8 rows of a projection (kernels/cuda/fp8_gemm.cuh): w the first row's
  // bytes, w_scale its block row's scales.
  absl::Status Fp8Gemm(const bf16* x, int64_t x_stride, int64_t rows, int64_t k, const uint8_t* w,
                       const float* w_scale, int64_t n, float* out, int64_t out_stride);
  // GpuModelOptions::fp8_shared_act_quant (engine/gpu/gpu_model_quant.cc).
  // Whether an input of [rows, k] is quantized once into `slot` (the option on, W8A8, k and
  // group_cols (0: k) multiples of 128 with group_cols dividing k, room in the slot, fp8_gemm on
  // its cuBLASLt path at `rows`).
  bool SharedActQuant(int64_t rows, int64_t k, int slot, int64_t group_cols = 0) const;
  // y [rows, k] (contiguous) = bf16(x [rows, k], row stride x_stride), as CastRows; when
  // SharedActQuant(rows, k) (and x 16-byte aligned with x_stride a multiple of 4) also quantized
  // into slot `slot` by the same kernel (in column groups of group_cols, 0: one), and returned.
  absl::StatusOr<QuantizedRows> CastForGemm(const float* x, int64_t rows, int64_t k,
                                            int64_t x_stride, bf16* y, int slot,
                                            int64_t group_cols = 0);
  // y [rows, cols] = bf16(clamped_swiglu(gate_in, up_in)) ([rows, in_stride] fp32 each), as
  // clamped_swiglu into out [rows, cols] fp32 then Cast; when SharedActQuant(rows, cols) one
  // fused kernel writes y and the quantized rows of slot `slot` instead (out not written).
  absl::StatusOr<QuantizedRows> SwiGluForGemm(const float* gate_in, const float* up_in,
                                              int64_t rows, int64_t cols, int64_t in_stride,
                                              float limit, float* out, bf16* y, int slot);
  // fp8_shared_act_quant (or PDSERVE_FP8_SHARED_ACT_QUANT) with W8A8 FP8 weights.
  bool SharedActQuantWanted() const;
  // The buffers of fp8_shared_act_quant (nothing when it is off or does not apply).
  absl::Status AllocateSharedActQuant();
  // out [rows, n] fp32 (row stride out_stride) = rows_q @ W^T through fp8_gemm_quantized: rows_q
  // and rows_s one (group of) quantized rows, w / w_scale the first weight row's bytes and its
  // block row's scales.
  absl::Status Fp8GemmQuantized(const uint8_t* rows_q, const float* rows_s, int64_t rows, int64_t k,
                                const uint8_t* w, const float* w_scale, int64_t n, float* out,
                                int64_t out_stride);
  // FP8 o_a as one fp8_gemm per group over attn (cast to attn_bf here; with fp8_shared_act_quant
  // each group's rows quantized in the same kernel and multiplied through fp8_gemm_quantized).
  absl::Status Fp8OaPerGroup(const Layer& layer, int64_t rows);
  // One layer's routed experts: FP8 from `stored` (null outside kFp8Block) when it holds both
  // projections, else bf16 from `w`. prefix "model.layers.N.mlp.experts".
  absl::Status LoadRoutedExperts(const Weights& w, const StoredExperts* stored,
                                 const std::string& prefix, Layer* layer);
  int64_t logged_bf16_experts = 0;
  // The FP8 experts' buffers, sized for the layers that hold them (nothing without them).
  absl::Status AllocateFp8Experts();
  absl::Status Allocate();
  // y[rows, n] = x[rows, k] @ W[n, k]^T, fp32 out, all rows contiguous. x_rounded is x already
  // rounded to bf16 (x_rounded, read in GemmInputs::kBf16), x_f32 the fp32 source (read in kFp32).
  // xq (CastForGemm / SwiGluForGemm's rows of x_rounded, when set): an FP8 w with n a multiple
  // of 128 multiplies them (fp8_gemm_quantized) instead of quantizing x_rounded again.
  absl::Status Gemm(const float* x_f32, const bf16* x_rounded, int64_t rows, int64_t k,
                    const Linear& w, int64_t n, float* y, const QuantizedRows& xq = {});
  // As Gemm with fp32 x and W (hyper-connection mixes, the router).
  absl::Status GemmF32(const float* x, int64_t rows, int64_t k, const float* w, int64_t n,
                       float* y);
  absl::Status Cast(const float* x, int64_t n, bf16* y) {
    return CudaStatus(CastToBf16(x, n, y, stream), "CastToBf16");
  }
  // y[rows, cols] (contiguous) = bf16(x[rows, cols] with row stride `stride`): Cast when the rows
  // are contiguous (the unfused path), else CastRowsToBf16 (a fused group's output slice).
  absl::Status CastRows(const float* x, int64_t rows, int64_t cols, int64_t stride, bf16* y) {
    if (stride == cols) return Cast(x, rows * cols, y);
    return CudaStatus(CastRowsToBf16(x, rows, cols, stride, y, stream), "CastRowsToBf16");
  }
  // Loads layer l's fused groups (options.fused_projections); attn_fused / ffn_fused: whether
  // each group was fused (else its parts are still to be loaded one by one).
  absl::Status LoadFusedGroups(const LinearSource& src, int64_t l, Layer* layer, bool* attn_fused,
                               bool* ffn_fused);
  // o_a's groups of rows attn_bf [rows, heads * hd] -> grouped_bf [rows, groups * o_lora] in one
  // moe_grouped_gemm call (o_a_grouped).
  absl::Status GroupedOa(const Layer& layer, int64_t rows);
  // The fused buffers (o_a ids, output, workspace) for the groups Load fused.
  absl::Status AllocateFused();
  absl::Status HcPre(const HcWeights& hc, const DeviceArray<float>& norm, int64_t rows);
  // Sets fused_hc_pre from FusedHcPreWanted and the shapes (after Load and Allocate).
  void EnableFusedHcPre();
  // decode: one token per segment at a bucket's row count (the fixed-shape decode kernels, the
  // ring written before attention); else the any-shape path.
  absl::Status Attention(Layer& layer, int64_t rows, const SegmentArrays& segs, bool decode);
  // The fixed-shape decode kernel's parameters for `layer` over `batch` decode rows (pointers to
  // this Impl's buffers), and the workspace that needs.
  kc::SparseDecodeParams DecodeParams(const Layer& layer, int64_t batch);
  size_t DecodeWorkspace(const Layer& layer, int64_t batch) {
    return kc::SparseDecodeWorkspaceBytes(DecodeParams(layer, batch));
  }
  absl::Status FastIndexer(Layer& layer, int64_t rows);
  absl::Status FastAttention(Layer& layer, int64_t rows);
  absl::Status Moe(Layer& layer, int64_t rows);
  // The routed experts of an expert-parallel rank: gather the group's rows, run this rank's
  // experts on all of them, reduce-scatter the sums back and add this rank's rows to sub_out.
  absl::Status ExpertParallelMoe(Layer& layer, int64_t rows);
  // The routed experts over `rows` rows of x (bf16 [rows, hidden]) with picks `experts` (ids in
  // [0, n_experts of the layer's experts), others skipped) and weights [rows, k]: out [rows,
  // hidden] fp32 += the picks' weighted outputs. FP8 experts (moe_gemm) or bf16 (moe_experts).
  absl::Status RoutedExperts(const Layer& layer, const bf16* x, int64_t rows,
                             const int32_t* experts, const float* weights, int64_t n_experts,
                             float* out);
  // Every kernel of one call over `rows` stacked rows in `segs.segments` segments (metadata
  // already on the device): the part a decode graph captures.
  absl::Status Enqueue(int64_t rows, int64_t segments, int64_t max_tokens, bool decode);
  bool IsBucket(int64_t rows) const {
    return std::binary_search(options.decode_buckets.begin(), options.decode_buckets.end(), rows);
  }
  // Stages the metadata, copies it, runs Enqueue or the graph, and copies the work's logits back.
  // Rows past the work's are padding (one token at position 0 of the scratch slot each). decode:
  // as Attention's (only with one token per segment and a bucket's rows). to_host false: the
  // logits stay in `logits` and an empty tensor is returned; the stream is synchronized only in
  // an expert-parallel group.
  // DecodeStep's checks and call of Run.
  absl::StatusOr<Tensor> Decode(const std::vector<int64_t>& slots,
                                const std::vector<int32_t>& tokens, bool use_graph,
                                int64_t group_rows, bool to_host);
  // Run in two halves: Begin stages and enqueues everything (the logits' copy to the host too),
  // advances the work's positions and returns; Finish synchronizes (when to_host or in a group)
  // and returns the logits. FailedPrecondition for a Begin while one is pending or a Finish
  // without one.
  struct Pending {
    int64_t host_rows = 0;  // logits rows copied to logits_host (from row 0 there)
    bool to_host = true;
  };
  std::optional<Pending> pending;
  // last_row: only the last real row's logits go to the host (ChunkLogits::kLastRow).
  absl::Status Begin(const std::vector<std::pair<int64_t, std::vector<int32_t>>>& work,
                     int64_t padded_rows, bool use_graph, bool decode, bool to_host,
                     bool last_row = false);
  absl::StatusOr<Tensor> Finish();
  absl::StatusOr<Tensor> Run(const std::vector<std::pair<int64_t, std::vector<int32_t>>>& work,
                             int64_t padded_rows, bool use_graph, bool decode, bool to_host = true);
};

}  // namespace pdserve::engine::gpu
