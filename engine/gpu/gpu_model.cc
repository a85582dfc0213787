#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/gpu_model_impl.h"
#include "engine/quant.h"
#include "kernels/env_switch.h"

namespace pdserve::engine::gpu {

absl::Status GpuModel::Impl::Gemm(const float* x_f32, const bf16* x_rounded, int64_t rows,
                                  int64_t k, const Linear& w, int64_t n, float* y,
                                  const QuantizedRows& xq) {
  if (rows == 0) return absl::OkStatus();
  if (options.gemm_inputs == GemmInputs::kFp32) {
    return GemmF32(x_f32, rows, k, w.f32.get(), n, y);
  }
  if (w.is_fp8()) {
    // Where fp8_gemm takes cuBLASLt, fp8_gemm_quantized on the same rows gives its bits.
    if (xq.q != nullptr && xq.rows == rows && xq.k == k && xq.group_cols == k &&
        n % kc::kFp8LtRowBlock == 0) {
      return Fp8GemmQuantized(xq.q, xq.s, rows, k, w.fp8_weight(), w.fp8_scales(), n, y, n);
    }
    // fp32 output, as cuBLAS gives the bf16 path below: no bf16 rounding of the sums.
    return Fp8Gemm(x_rounded, k, rows, k, w.fp8_weight(), w.fp8_scales(), n, y, n);
  }
  const float alpha = 1.0f;
  const float beta = 0.0f;
  // Row-major y[rows, n] = x[rows, k] W[n, k]^T is column-major y^T[n, rows] = W^T x^T.
  PDSERVE_CUBLAS_RETURN(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                     static_cast<int>(rows), static_cast<int>(k), &alpha,
                                     w.bf_weight(), CUDA_R_16BF, static_cast<int>(k), x_rounded,
                                     CUDA_R_16BF, static_cast<int>(k), &beta, y, CUDA_R_32F,
                                     static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::Fp8Gemm(const bf16* x, int64_t x_stride, int64_t rows, int64_t k,
                                     const uint8_t* w, const float* w_scale, int64_t n, float* out,
                                     int64_t out_stride) {
  std::string refusal;
  // AllocateFp8 sizes the workspace for both fp8_gemm and fp8_gemm_w8a16.
  const bool a16 = options.fp8_activations == Fp8Activations::kBf16;
  const cudaError_t e =
      a16 ? kc::fp8_gemm_w8a16(x, rows, k, x_stride, w, w_scale, n, out, out_stride,
                               fp8_workspace.get(), fp8_workspace.size(), stream, &refusal)
          : kc::fp8_gemm(x, rows, k, x_stride, w, w_scale, n, /*ue8m0_act_scale=*/false, out,
                         out_stride, fp8_workspace.get(), fp8_workspace.size(), stream, &refusal);
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(a16 ? "fp8_gemm_w8a16: " : "fp8_gemm: ", cudaGetErrorString(e),
                   refusal.empty() ? "" : ": ", refusal));
}

absl::Status GpuModel::Impl::GemmF32(const float* x, int64_t rows, int64_t k, const float* w,
                                     int64_t n, float* y) {
  if (rows == 0) return absl::OkStatus();
  const float alpha = 1.0f;
  const float beta = 0.0f;
  PDSERVE_CUBLAS_RETURN(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                    static_cast<int>(rows), static_cast<int>(k), &alpha, w,
                                    static_cast<int>(k), x, static_cast<int>(k), &beta, y,
                                    static_cast<int>(n)));
  return absl::OkStatus();
}

// collapsed = rms(input) (the normalized sublayer input) from the hyper-connection streams.
absl::Status GpuModel::Impl::HcPre(const HcWeights& hc, const DeviceArray<float>& norm,
                                   int64_t rows) {
  const ModelConfig& c = config;
  const int64_t flat_dim = c.hc_mult * c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (fused_hc_pre) {
    // `flat` is the partials workspace (EnableFusedHcPre checked its size).
    PDSERVE_CUDA_RETURN(kc::hyper_connection_pre_fused(
        streams.get(), rows, c.hc_mult, c.hidden_size, hc.fn.get(), hc.base.get(), hc.scale.get(),
        static_cast<float>(c.hc_eps), c.hc_sinkhorn_iters, norm.get(), eps, flat.get(),
        static_cast<int64_t>(flat.size()), post.get(), comb.get(), collapsed.get(), stream,
        hc_pre_programmatic));
    return absl::OkStatus();
  }
  PDSERVE_CUDA_RETURN(
      kc::rms_norm(streams.get(), nullptr, rows, flat_dim, flat_dim, eps, flat.get(), stream));
  PDSERVE_RETURN_IF_ERROR(GemmF32(flat.get(), rows, flat_dim, hc.fn.get(), hc.outputs, mix.get()));
  PDSERVE_CUDA_RETURN(kc::hyper_connection_pre(mix.get(), streams.get(), rows, c.hc_mult,
                                               c.hidden_size, hc.base.get(), hc.scale.get(),
                                               static_cast<float>(c.hc_eps), c.hc_sinkhorn_iters,
                                               post.get(), comb.get(), collapsed.get(), stream));
  PDSERVE_CUDA_RETURN(kc::rms_norm(collapsed.get(), norm.get(), rows, c.hidden_size, c.hidden_size,
                                   eps, collapsed.get(), stream));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::Attention(Layer& layer, int64_t rows, const SegmentArrays& segs,
                                       bool decode) {
  const ModelConfig& c = config;
  const int64_t hidden = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  const int64_t hd = c.head_dim;
  const int64_t q_lora = c.q_lora_rank;
  const int64_t rope_dim = c.qk_rope_head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scaling = layer.rope->attention_scaling();
  const float* inv_freq = layer.inv_freq->get();
  const int32_t* positions = Row(kPosition);

  PDSERVE_ASSIGN_OR_RETURN(const QuantizedRows xq,
                           CastForGemm(collapsed.get(), rows, hidden, hidden, x_bf.get(), 0));
  // Fused (engine/fused_projections.h): one GEMM writes every projection of x, [rows, fs]; each
  // consumer reads its columns (row stride fs) where the unfused path has a buffer of its own.
  const bool fused_in = layer.attn_in.out > 0;
  const int64_t fs = layer.attn_in.out;
  if (fused_in) {
    PDSERVE_RETURN_IF_ERROR(
        Gemm(collapsed.get(), x_bf.get(), rows, hidden, layer.attn_in, fs, fused_out.get(), xq));
  }
  auto slice = [&](const Linear& part) { return fused_out.get() + part.fused_col; };
  float* q_a_out = fused_in ? slice(layer.q_a_proj) : q_res.get();
  const int64_t q_a_stride = fused_in ? fs : q_lora;
  if (!fused_in) {
    PDSERVE_RETURN_IF_ERROR(
        Gemm(collapsed.get(), x_bf.get(), rows, hidden, layer.q_a_proj, q_lora, q_res.get(), xq));
  }
  PDSERVE_CUDA_RETURN(
      kc::rms_norm(q_a_out, layer.q_a_norm.get(), rows, q_lora, q_a_stride, eps, q_a_out, stream));
  PDSERVE_ASSIGN_OR_RETURN(const QuantizedRows q_res_q,
                           CastForGemm(q_a_out, rows, q_lora, q_a_stride, q_res_bf.get(), 1));
  PDSERVE_RETURN_IF_ERROR(Gemm(q_res.get(), q_res_bf.get(), rows, q_lora, layer.q_b_proj,
                               heads * hd, q.get(), q_res_q));
  PDSERVE_CUDA_RETURN(kc::rms_norm(q.get(), nullptr, rows * heads, hd, hd, eps, q.get(), stream));
  PDSERVE_CUDA_RETURN(kc::apply_interleaved_rope(q.get(), rows, heads * hd, heads, hd, rope_dim,
                                                 positions, inv_freq, scaling, false, stream));
  float* kv_out = fused_in ? slice(layer.kv_proj) : kv.get();
  const int64_t kv_stride = fused_in ? fs : hd;
  if (!fused_in) {
    PDSERVE_RETURN_IF_ERROR(
        Gemm(collapsed.get(), x_bf.get(), rows, hidden, layer.kv_proj, hd, kv.get(), xq));
  }
  PDSERVE_CUDA_RETURN(
      kc::rms_norm(kv_out, layer.kv_norm.get(), rows, hd, kv_stride, eps, kv_out, stream));
  PDSERVE_CUDA_RETURN(kc::apply_interleaved_rope(kv_out, rows, kv_stride, 1, hd, rope_dim,
                                                 positions, inv_freq, scaling, false, stream));
  PDSERVE_RETURN_IF_ERROR(CastRows(kv_out, rows, hd, kv_stride, new_kv.get()));

  auto update = [&](CompressorWeights& cw) -> absl::Status {
    const int64_t width = cw.width();
    kc::CompressorParams p;
    if (fused_in) {
      p.kv = slice(cw.kv_proj);
      p.gate = slice(cw.gate_proj);
      p.source_stride = fs;
    } else {
      PDSERVE_RETURN_IF_ERROR(
          Gemm(collapsed.get(), x_bf.get(), rows, hidden, cw.kv_proj, width, comp_kv.get(), xq));
      PDSERVE_RETURN_IF_ERROR(Gemm(collapsed.get(), x_bf.get(), rows, hidden, cw.gate_proj, width,
                                   comp_gate.get(), xq));
      p.kv = comp_kv.get();
      p.gate = comp_gate.get();
    }
    p.dim = cw.dim;
    p.overlapping = cw.overlapping;
    p.rate = cw.rate;
    p.first_position = segs.first_position;
    p.n_tokens = segs.n_tokens;
    p.row_offset = segs.row_offset;
    p.slot = segs.slot;
    p.segments = segs.segments;
    p.max_tokens = segs.max_tokens;
    p.ring_kv = cw.ring_kv.get();
    p.ring_gate = cw.ring_gate.get();
    p.entries = cw.entries.get();
    p.entry_capacity = cw.capacity;
    p.entry_pages = EntryPagesOf(cw);
    p.position_bias = cw.position_bias.get();
    p.norm_weight = cw.kv_norm.get();
    p.eps = eps;
    p.inv_freq = inv_freq;
    p.attention_scaling = scaling;
    p.rope_dim = rope_dim;
    PDSERVE_CUDA_RETURN(kc::compressor_update(p, stream));
    return absl::OkStatus();
  };
  if (layer.has_compressor) PDSERVE_RETURN_IF_ERROR(update(layer.compressor));
  if (layer.has_indexer) {
    CompressorWeights& ic = layer.indexer_compressor;
    PDSERVE_RETURN_IF_ERROR(update(ic));
    const int64_t ih = c.index_n_heads;
    const int64_t ihd = c.index_head_dim;
    PDSERVE_RETURN_IF_ERROR(Gemm(q_res.get(), q_res_bf.get(), rows, q_lora, layer.indexer_q_b_proj,
                                 ih * ihd, idx_q.get(), q_res_q));
    PDSERVE_CUDA_RETURN(kc::apply_interleaved_rope(idx_q.get(), rows, ih * ihd, ih, ihd, rope_dim,
                                                   positions, inv_freq, scaling, false, stream));
    const float weights_scale = 1.0f / std::sqrt(static_cast<float>(ih));
    if (fused_in) {
      PDSERVE_CUDA_RETURN(ScaleRows(slice(layer.indexer_weights_proj), rows, ih, fs, weights_scale,
                                    idx_w.get(), stream));
    } else {
      PDSERVE_RETURN_IF_ERROR(Gemm(collapsed.get(), x_bf.get(), rows, hidden,
                                   layer.indexer_weights_proj, ih, idx_w.get(), xq));
      PDSERVE_CUDA_RETURN(Scale(idx_w.get(), rows * ih, weights_scale, stream));
    }
    if (decode && fast_indexer) {
      PDSERVE_RETURN_IF_ERROR(FastIndexer(layer, rows));
    } else {
      PDSERVE_CUDA_RETURN(kc::indexer_scores_generic(
          idx_q.get(), idx_w.get(), rows, ih, ihd, ic.entries.get(), ic.capacity, Row(kSlot),
          positions, ic.rate, 1.0f / std::sqrt(static_cast<float>(ihd)), ic.capacity,
          idx_scores.get(), idx_visible.get(), stream, EntryPagesOf(ic)));
      PDSERVE_CUDA_RETURN(kc::top_k(idx_scores.get(), rows, ic.capacity, idx_visible.get(),
                                    c.index_topk, picks.get(), stream));
    }
  }
  // A decode row's own key goes into the ring first (its slot held position t - W, which no
  // query of this call sees); a longer chunk appends after attention, since its early queries
  // still read ring rows its later rows would overwrite.
  if (decode) {
    PDSERVE_CUDA_RETURN(
        WindowAppend(segs, new_kv.get(), hd, c.sliding_window, layer.window_ring.get(), stream));
  }
  if (decode && fast_attention) {
    PDSERVE_RETURN_IF_ERROR(FastAttention(layer, rows));
  } else {
    kc::SinkAttentionParams ap;
    ap.q = q.get();
    ap.rows = rows;
    ap.heads = heads;
    ap.head_dim = hd;
    ap.slot_of_row = Row(kSlot);
    ap.position_of_row = positions;
    ap.first_position = Row(kFirstPosition);
    ap.first_row = Row(kFirstRow);
    ap.new_kv = new_kv.get();
    ap.window_ring = layer.window_ring.get();
    ap.window = c.sliding_window;
    if (layer.has_compressor) {
      ap.entries = layer.compressor.entries.get();
      ap.entry_capacity = layer.compressor.capacity;
      ap.entry_pages = EntryPagesOf(layer.compressor);
      ap.rate = layer.compressor.rate;
      ap.indices = layer.has_indexer ? picks.get() : nullptr;
      ap.compressed_slots = layer.has_indexer ? c.index_topk : layer.compressor.capacity;
    }
    ap.sinks = layer.sinks.get();
    ap.softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd));
    PDSERVE_CUDA_RETURN(kc::sink_attention(ap, attn.get(), stream));
  }
  PDSERVE_CUDA_RETURN(kc::apply_interleaved_rope(attn.get(), rows, heads * hd, heads, hd, rope_dim,
                                                 positions, inv_freq, scaling, true, stream));
  if (!decode) {
    PDSERVE_CUDA_RETURN(
        WindowAppend(segs, new_kv.get(), hd, c.sliding_window, layer.window_ring.get(), stream));
  }

  // Grouped output projection: group g's heads [rows, heads * hd / G] -> [rows, o_lora].
  const int64_t groups = c.o_groups;
  const int64_t group_in = heads * hd / groups;
  const int64_t o_lora = c.o_lora_rank;
  // FP8 o_a one group at a time casts (and may quantize) attn itself.
  const bool fp8_per_group = options.gemm_inputs != GemmInputs::kFp32 && layer.o_a_proj.is_fp8() &&
                             !(o_a_grouped && rows <= kOaGroupedMaxRows);
  if (!fp8_per_group) PDSERVE_RETURN_IF_ERROR(Cast(attn.get(), rows * heads * hd, attn_bf.get()));
  const float alpha = 1.0f;
  const float beta = 0.0f;
  if (options.gemm_inputs == GemmInputs::kFp32) {
    PDSERVE_CUBLAS_RETURN(cublasSgemmStridedBatched(
        cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(o_lora), static_cast<int>(rows),
        static_cast<int>(group_in), &alpha, layer.o_a_proj.f32.get(), static_cast<int>(group_in),
        o_lora * group_in, attn.get(), static_cast<int>(heads * hd), group_in, &beta, grouped.get(),
        static_cast<int>(groups * o_lora), o_lora, static_cast<int>(groups)));
  } else if (layer.o_a_proj.is_fp8() && o_a_grouped && rows <= kOaGroupedMaxRows) {
    // Writes grouped_bf itself (bf16, as the Cast below would round the fp32 sums).
    PDSERVE_RETURN_IF_ERROR(GroupedOa(layer, rows));
    return Gemm(grouped.get(), grouped_bf.get(), rows, groups * o_lora, layer.o_b_proj, hidden,
                sub_out.get());
  } else if (fp8_per_group) {
    PDSERVE_RETURN_IF_ERROR(Fp8OaPerGroup(layer, rows));
  } else {
    PDSERVE_CUBLAS_RETURN(cublasGemmStridedBatchedEx(
        cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(o_lora), static_cast<int>(rows),
        static_cast<int>(group_in), &alpha, layer.o_a_proj.bf_weight(), CUDA_R_16BF,
        static_cast<int>(group_in), o_lora * group_in, attn_bf.get(), CUDA_R_16BF,
        static_cast<int>(heads * hd), group_in, &beta, grouped.get(), CUDA_R_32F,
        static_cast<int>(groups * o_lora), o_lora, static_cast<int>(groups), CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
  }
  const int64_t o_width = groups * o_lora;
  PDSERVE_ASSIGN_OR_RETURN(const QuantizedRows grouped_q,
                           CastForGemm(grouped.get(), rows, o_width, o_width, grouped_bf.get(), 0));
  return Gemm(grouped.get(), grouped_bf.get(), rows, o_width, layer.o_b_proj, hidden, sub_out.get(),
              grouped_q);
}

kc::SparseDecodeParams GpuModel::Impl::DecodeParams(const Layer& layer, int64_t batch) {
  const ModelConfig& c = config;
  kc::SparseDecodeParams p;
  p.q = q_bf.get();
  p.batch = batch;
  p.heads = c.num_attention_heads;
  p.window_pool = layer.window_ring.get();
  p.window_page = Row(kSlot);  // a slot's ring is one window page
  p.window_len = window_len.get();
  p.window_size = c.sliding_window;
  if (layer.has_compressor) {
    p.kv_pool = layer.compressor.entries.get();
    p.page_table = page_table.get();
    p.page_table_stride = layer.compressor.capacity / kPageSize;
    p.page_size = kPageSize;
    p.n_compressed = n_compressed.get();
    p.indices = layer.has_indexer ? picks.get() : nullptr;
    p.compressed_slots = layer.has_indexer ? c.index_topk : layer.compressor.capacity;
  } else {
    p.n_compressed = window_len.get();  // read by nothing: no compressed slots
    p.compressed_slots = 0;
  }
  p.sinks = layer.sinks.get();
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  p.entries_per_split = kc::SparseDecodeEntriesPerSplit(
      batch, p.heads, p.window_size + p.compressed_slots, std::max(sm_count, 1));
  return p;
}

absl::Status GpuModel::Impl::FastIndexer(Layer& layer, int64_t rows) {
  const ModelConfig& c = config;
  CompressorWeights& ic = layer.indexer_compressor;
  PDSERVE_CUDA_RETURN(DecodePageTables(Row(kSlot), Row(kPosition), rows, c.sliding_window, ic.rate,
                                       ic.capacity, kPageSize, SlotPagesOf(ic), window_len.get(),
                                       n_compressed.get(), page_table.get(), stream));
  PDSERVE_RETURN_IF_ERROR(
      Cast(idx_q.get(), rows * c.index_n_heads * c.index_head_dim, idx_q_bf.get()));
  kc::IndexerParams p;
  p.q = idx_q_bf.get();
  p.weights = idx_w.get();
  p.key_pool = ic.entries.get();
  p.page_table = page_table.get();
  p.page_table_stride = ic.capacity / kPageSize;
  p.page_size = kPageSize;
  p.n_keys = n_compressed.get();
  p.positions = Row(kPosition);
  p.rate = ic.rate;
  p.batch = rows;
  p.max_keys = ic.capacity;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.index_head_dim));
  PDSERVE_CUDA_RETURN(kc::lightning_indexer(p, c.index_topk, idx_scores.get(), idx_visible.get(),
                                            picks.get(), stream));
  if (options.test_lowest_score_indexer) {
    // TEST ONLY (GpuModelOptions): the top-k of the negated scores, the lowest-scoring entries.
    PDSERVE_CUDA_RETURN(Scale(idx_scores.get(), rows * ic.capacity, -1.0f, stream));
    PDSERVE_CUDA_RETURN(kc::top_k(idx_scores.get(), rows, ic.capacity, idx_visible.get(),
                                  c.index_topk, picks.get(), stream));
  }
  if (options.test_unmasked_indexer) {  // TEST ONLY (GpuModelOptions): -1 slots keep their number
    PDSERVE_CUDA_RETURN(UnmaskSlots(picks.get(), rows, c.index_topk, stream));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::FastAttention(Layer& layer, int64_t rows) {
  const ModelConfig& c = config;
  const int64_t n = rows * c.num_attention_heads * c.head_dim;
  const int64_t rate = layer.has_compressor ? layer.compressor.rate : 1;
  const int64_t capacity = layer.has_compressor ? layer.compressor.capacity : 0;
  PDSERVE_CUDA_RETURN(
      DecodePageTables(Row(kSlot), Row(kPosition), rows, c.sliding_window, rate, capacity,
                       kPageSize, layer.has_compressor ? SlotPagesOf(layer.compressor) : nullptr,
                       window_len.get(), n_compressed.get(), page_table.get(), stream));
  PDSERVE_RETURN_IF_ERROR(Cast(q.get(), n, q_bf.get()));
  const kc::SparseDecodeParams p = DecodeParams(layer, rows);
  PDSERVE_CUDA_RETURN(kc::sparse_decode_attention(p, attn_workspace.get(), attn_workspace.size(),
                                                  attn_bf.get(), stream));
  PDSERVE_CUDA_RETURN(CastToF32(attn_bf.get(), n, attn.get(), stream));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::Moe(Layer& layer, int64_t rows) {
  const ModelConfig& c = config;
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.moe_intermediate_size;
  const float limit = static_cast<float>(c.swiglu_limit);
  PDSERVE_ASSIGN_OR_RETURN(const QuantizedRows xq,
                           CastForGemm(collapsed.get(), rows, hidden, hidden, x_bf.get(), 0));
  // Shared expert first: it initializes sub_out. Fused: gate and up in one GEMM, [rows, fs].
  if (layer.ffn_in.out > 0) {
    const int64_t fs = layer.ffn_in.out;
    PDSERVE_RETURN_IF_ERROR(
        Gemm(collapsed.get(), x_bf.get(), rows, hidden, layer.ffn_in, fs, fused_out.get(), xq));
  } else {
    PDSERVE_RETURN_IF_ERROR(Gemm(collapsed.get(), x_bf.get(), rows, hidden, layer.shared_gate,
                                 inter, sh_gate.get(), xq));
    PDSERVE_RETURN_IF_ERROR(
        Gemm(collapsed.get(), x_bf.get(), rows, hidden, layer.shared_up, inter, sh_up.get(), xq));
  }
  const bool fused_ffn = layer.ffn_in.out > 0;
  const float* swiglu_gate =
      fused_ffn ? fused_out.get() + layer.shared_gate.fused_col : sh_gate.get();
  const float* swiglu_up = fused_ffn ? fused_out.get() + layer.shared_up.fused_col : sh_up.get();
  PDSERVE_ASSIGN_OR_RETURN(
      const QuantizedRows act_rows,
      SwiGluForGemm(swiglu_gate, swiglu_up, rows, inter, fused_ffn ? layer.ffn_in.out : inter,
                    limit, sh_gate.get(), act_bf.get(), 1));
  PDSERVE_RETURN_IF_ERROR(Gemm(sh_gate.get(), act_bf.get(), rows, inter, layer.shared_down, hidden,
                               sub_out.get(), act_rows));

  // The router is replicated: every rank routes its own rows to global expert ids.
  PDSERVE_RETURN_IF_ERROR(GemmF32(collapsed.get(), rows, hidden, layer.gate.get(),
                                  c.n_routed_experts, router_logits.get()));
  kc::MoeScoring scoring = kc::MoeScoring::kSqrtSoftplus;
  if (c.scoring_func == ScoringFunc::kSigmoid) scoring = kc::MoeScoring::kSigmoid;
  if (c.scoring_func == ScoringFunc::kSoftmax) scoring = kc::MoeScoring::kSoftmax;
  PDSERVE_CUDA_RETURN(kc::moe_route(router_logits.get(), rows, c.n_routed_experts,
                                    c.num_experts_per_tok, scoring,
                                    layer.hash ? nullptr : layer.correction_bias.get(),
                                    layer.hash ? layer.tid2eid.get() : nullptr, Row(kToken),
                                    static_cast<float>(c.routed_scaling_factor),
                                    route_experts.get(), route_weights.get(), stream));
  if (comm != nullptr) return ExpertParallelMoe(layer, rows);
  return RoutedExperts(layer, x_bf.get(), rows, route_experts.get(), route_weights.get(),
                       c.n_routed_experts, sub_out.get());
}

absl::Status GpuModel::Impl::RoutedExperts(const Layer& layer, const bf16* x, int64_t rows,
                                           const int32_t* experts, const float* weights,
                                           int64_t n_experts, float* out) {
  const ModelConfig& c = config;
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.moe_intermediate_size;
  const int64_t k = c.num_experts_per_tok;
  const float limit = static_cast<float>(c.swiglu_limit);
  if (!layer.gate_up8.present()) {
    PDSERVE_CUDA_RETURN(kc::moe_experts(x, rows, hidden, inter, k, n_experts, layer.gate_up.get(),
                                        layer.down.get(), experts, weights, limit,
                                        moe_workspace.get(), moe_workspace.size(), out, stream));
    return absl::OkStatus();
  }
  // gate|up per pick (bf16), the clamped SwiGLU (bf16), the weighted down projection per pick
  // (bf16), then the picks' sum into out in fp32 (kernels/cuda/moe_gemm.cuh).
  void* ws = moe_gemm_workspace.get();
  const size_t ws_bytes = moe_gemm_workspace.size();
  PDSERVE_CUDA_RETURN(kc::moe_grouped_gemm(x, hidden, /*x_per_pick=*/false, experts, nullptr, rows,
                                           k, layer.gate_up8.View(), /*ue8m0=*/false,
                                           moe_gate_up.get(), 2 * inter, ws, ws_bytes, stream));
  PDSERVE_CUDA_RETURN(kc::clamped_swiglu(moe_gate_up.get(), moe_gate_up.get() + inter, rows * k,
                                         inter, 2 * inter, limit, moe_act.get(), inter, stream));
  // The same picks as the gate|up call, on the same workspace with nothing in between on it:
  // its grouping is reused (no second grouping kernel).
  PDSERVE_CUDA_RETURN(kc::moe_grouped_gemm(moe_act.get(), inter, /*x_per_pick=*/true, experts,
                                           weights, rows, k, layer.down8.View(), /*ue8m0=*/false,
                                           moe_down.get(), hidden, ws, ws_bytes, stream,
                                           /*refusal=*/nullptr, kc::MoeMmaGrouping::kReuse));
  PDSERVE_CUDA_RETURN(kc::moe_combine(moe_down.get(), hidden, experts, rows, k, n_experts, hidden,
                                      out, hidden, stream));
  return absl::OkStatus();
}

// A first version of the dispatch (docs/engine-gpu.md, "Several GPUs"): every rank sees every
// row of the group and computes its own experts' share for the rows that picked them (the kernel
// skips picks of other ranks' experts, so the work is the rank's picks, not all rows); the bytes
// moved are world * rows * (hidden bf16 + k picks) in and world * rows * hidden fp32 back, the
// same as an all-to-all whose buffers have room for every row. The partial sums stay fp32.
absl::Status GpuModel::Impl::ExpertParallelMoe(Layer& layer, int64_t rows) {
  const ModelConfig& c = config;
  const int64_t hidden = c.hidden_size;
  const int64_t k = c.num_experts_per_tok;
  const int64_t all_rows = comm->world() * rows;
  const auto r = static_cast<size_t>(rows);
  const ExpertComm::Gather gathers[] = {
      {x_bf.get(), ep_x.get(), r * static_cast<size_t>(hidden) * sizeof(bf16)},
      {route_experts.get(), ep_experts.get(), r * static_cast<size_t>(k) * sizeof(int32_t)},
      {route_weights.get(), ep_weights.get(), r * static_cast<size_t>(k) * sizeof(float)},
  };
  PDSERVE_RETURN_IF_ERROR(comm->AllGather(gathers, stream));
  PDSERVE_CUDA_RETURN(LocalExpertIds(ep_experts.get(), all_rows * k, shard.first, shard.count,
                                     ep_experts.get(), stream));
  PDSERVE_CUDA_RETURN(cudaMemsetAsync(
      ep_out.get(), 0, static_cast<size_t>(all_rows * hidden) * sizeof(float), stream));
  PDSERVE_RETURN_IF_ERROR(RoutedExperts(layer, ep_x.get(), all_rows, ep_experts.get(),
                                        ep_weights.get(), shard.count, ep_out.get()));
  PDSERVE_RETURN_IF_ERROR(comm->ReduceScatterSum(ep_out.get(), ep_reduced.get(),
                                                 static_cast<size_t>(rows * hidden), stream));
  PDSERVE_CUDA_RETURN(AddInto(sub_out.get(), ep_reduced.get(), rows * hidden, stream));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::Enqueue(int64_t rows, int64_t segments, int64_t max_tokens,
                                     bool decode) {
  const ModelConfig& c = config;
  SegmentArrays segs;
  segs.first_position = Seg(kSegFirstPosition);
  segs.n_tokens = Seg(kSegTokens);
  segs.row_offset = Seg(kSegRowOffset);
  segs.slot = Seg(kSegSlot);
  segs.segments = segments;
  segs.max_tokens = max_tokens;
  PDSERVE_CUDA_RETURN(EmbedStreams(Row(kToken), rows, embed.get(), c.vocab_size, c.hidden_size,
                                   c.hc_mult, streams.get(), stream));
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& layer = layers[l];
    PDSERVE_RETURN_IF_ERROR(HcPre(layer.attn_hc, layer.input_norm, rows));
    PDSERVE_RETURN_IF_ERROR(Attention(layer, rows, segs, decode));
    if (after_attention) PDSERVE_RETURN_IF_ERROR(after_attention(static_cast<int64_t>(l)));
    PDSERVE_CUDA_RETURN(kc::hyper_connection_post(post.get(), comb.get(), sub_out.get(), rows,
                                                  c.hc_mult, c.hidden_size, streams.get(), stream));
    PDSERVE_RETURN_IF_ERROR(HcPre(layer.ffn_hc, layer.post_attention_norm, rows));
    PDSERVE_RETURN_IF_ERROR(Moe(layer, rows));
    PDSERVE_CUDA_RETURN(kc::hyper_connection_post(post.get(), comb.get(), sub_out.get(), rows,
                                                  c.hc_mult, c.hidden_size, streams.get(), stream));
  }
  const int64_t flat_dim = c.hc_mult * c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  PDSERVE_CUDA_RETURN(
      kc::rms_norm(streams.get(), nullptr, rows, flat_dim, flat_dim, eps, flat.get(), stream));
  PDSERVE_RETURN_IF_ERROR(
      GemmF32(flat.get(), rows, flat_dim, head_hc.fn.get(), head_hc.outputs, mix.get()));
  PDSERVE_CUDA_RETURN(kc::hyper_head(mix.get(), streams.get(), rows, c.hc_mult, c.hidden_size,
                                     head_hc.base.get(), head_hc.scale.get(),
                                     static_cast<float>(c.hc_eps), collapsed.get(), stream));
  PDSERVE_CUDA_RETURN(kc::rms_norm(collapsed.get(), final_norm.get(), rows, c.hidden_size,
                                   c.hidden_size, eps, collapsed.get(), stream));
  PDSERVE_RETURN_IF_ERROR(Cast(collapsed.get(), rows * c.hidden_size, x_bf.get()));
  return Gemm(collapsed.get(), x_bf.get(), rows, c.hidden_size, lm_head, c.vocab_size,
              logits.get());
}

absl::StatusOr<Tensor> GpuModel::Impl::Run(
    const std::vector<std::pair<int64_t, std::vector<int32_t>>>& work, int64_t padded_rows,
    bool use_graph, bool decode, bool to_host) {
  PDSERVE_RETURN_IF_ERROR(Begin(work, padded_rows, use_graph, decode, to_host));
  return Finish();
}

absl::Status GpuModel::Impl::Begin(
    const std::vector<std::pair<int64_t, std::vector<int32_t>>>& work, int64_t padded_rows,
    bool use_graph, bool decode, bool to_host, bool last_row) {
  if (pending.has_value()) {
    return absl::FailedPreconditionError("GpuModel: a begun forward was not finished");
  }
  const ModelConfig& c = config;
  int64_t real_rows = 0;
  int64_t max_tokens = 0;
  for (const auto& [slot, tokens] : work) {
    real_rows += static_cast<int64_t>(tokens.size());
    max_tokens = std::max<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  }
  const int64_t rows = std::max(padded_rows, real_rows);
  const int64_t segments = static_cast<int64_t>(work.size()) + (rows - real_rows);
  // Every page this step writes or reads, before anything is staged: a short pool fails the
  // call with ResourceExhausted and no state changed.
  std::vector<std::pair<int64_t, int64_t>> targets;
  for (const auto& [slot, tokens] : work) {
    targets.push_back(
        {slot, slot_positions[static_cast<size_t>(slot)] + static_cast<int64_t>(tokens.size())});
  }
  PDSERVE_RETURN_IF_ERROR(GrowPages(targets));
  if (rows > real_rows) max_tokens = std::max<int64_t>(max_tokens, 1);  // padding segments
  int32_t* row = rows_host.get();
  int32_t* seg = seg_host.get();
  auto set_row = [&](int64_t r, int32_t token, int64_t slot, int64_t pos, int64_t first_pos,
                     int64_t first_row) {
    row[kToken * max_rows + r] = token;
    row[kSlot * max_rows + r] = static_cast<int32_t>(slot);
    row[kPosition * max_rows + r] = static_cast<int32_t>(pos);
    row[kFirstPosition * max_rows + r] = static_cast<int32_t>(first_pos);
    row[kFirstRow * max_rows + r] = static_cast<int32_t>(first_row);
  };
  auto set_seg = [&](int64_t b, int64_t first_pos, int64_t n, int64_t offset, int64_t slot) {
    seg[kSegFirstPosition * max_rows + b] = static_cast<int32_t>(first_pos);
    seg[kSegTokens * max_rows + b] = static_cast<int32_t>(n);
    seg[kSegRowOffset * max_rows + b] = static_cast<int32_t>(offset);
    seg[kSegSlot * max_rows + b] = static_cast<int32_t>(slot);
  };
  int64_t r = 0;
  int64_t b = 0;
  for (const auto& [slot, tokens] : work) {
    const int64_t p0 = slot_positions[static_cast<size_t>(slot)];
    set_seg(b++, p0, static_cast<int64_t>(tokens.size()), r, slot);
    const int64_t first_row = r;
    for (size_t i = 0; i < tokens.size(); ++i, ++r) {
      set_row(r, tokens[i], slot, p0 + static_cast<int64_t>(i), p0, first_row);
    }
  }
  // Padding rows: one token at position 0 of the scratch slot each (identical, so their writes
  // to the scratch slot agree); their logits are dropped.
  for (; r < rows; ++r) {
    set_seg(b++, 0, 1, r, scratch_slot);
    set_row(r, 0, scratch_slot, 0, 0, r);
  }
  PDSERVE_CUDA_RETURN(cudaMemcpyAsync(rows_meta.get(), rows_host.get(),
                                      rows_meta.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                      stream));
  PDSERVE_CUDA_RETURN(cudaMemcpyAsync(seg_meta.get(), seg_host.get(),
                                      seg_meta.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                      stream));
  if (use_graph) {
    auto it = graphs.find(rows);
    if (it == graphs.end()) {
      PDSERVE_CUDA_RETURN(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
      const absl::Status enqueued = Enqueue(rows, segments, max_tokens, decode);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
      PDSERVE_RETURN_IF_ERROR(enqueued);
      PDSERVE_CUDA_RETURN(ended);
      cudaGraphExec_t exec = nullptr;
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      PDSERVE_CUDA_RETURN(inst);
      it = graphs.emplace(rows, exec).first;
    }
    PDSERVE_CUDA_RETURN(cudaGraphLaunch(it->second, stream));
  } else {
    PDSERVE_RETURN_IF_ERROR(Enqueue(rows, segments, max_tokens, decode));
  }
  // The real rows come first in `logits` (row stride vocab_size), the padding rows after them.
  const int64_t first_host_row = last_row ? std::max<int64_t>(real_rows - 1, 0) : 0;
  const int64_t host_rows = real_rows - first_host_row;
  if (to_host && host_rows > 0) {
    PDSERVE_CUDA_RETURN(
        cudaMemcpyAsync(logits_host.get(), logits.get() + first_host_row * c.vocab_size,
                        static_cast<size_t>(host_rows * c.vocab_size) * sizeof(float),
                        cudaMemcpyDeviceToHost, stream));
  }
  // The positions advance now: what is enqueued after this (ExportLayerAsync between Begin and
  // Finish) runs after the call on the stream and sees the new position.
  for (const auto& [slot, tokens] : work) {
    slot_positions[static_cast<size_t>(slot)] += static_cast<int64_t>(tokens.size());
  }
  pending = Pending{host_rows, to_host};
  return absl::OkStatus();
}

absl::StatusOr<Tensor> GpuModel::Impl::Finish() {
  if (!pending.has_value()) return absl::FailedPreconditionError("GpuModel: no begun forward");
  const Pending p = *pending;
  pending.reset();
  // Work enqueued on the stream from now on (the next forward, an import) runs after every
  // layer copy ForwardExporting / ExportLayerAsync put on the copy stream, as after the
  // stream's own copies.
  if (copy_stream != nullptr) {
    PDSERVE_CUDA_RETURN(cudaEventRecord(copies_enqueued, copy_stream));
    PDSERVE_CUDA_RETURN(cudaStreamWaitEvent(stream, copies_enqueued, 0));
  }
  // Logits left on the device: the caller synchronizes (a group still does, for its barrier).
  if (p.to_host || comm != nullptr) PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
  if (!p.to_host) return Tensor();
  Tensor out({p.host_rows, config.vocab_size});
  std::memcpy(out.ptr(), logits_host.get(), out.data.size() * sizeof(float));
  return out;
}

const ModelConfig& GpuModel::config() const { return impl_->config; }
int64_t GpuModel::slots() const { return impl_->options.slots; }
int64_t GpuModel::max_context() const { return impl_->max_context; }
int64_t GpuModel::max_chunk() const { return impl_->options.max_chunk; }
const std::vector<int64_t>& GpuModel::decode_buckets() const {
  return impl_->options.decode_buckets;
}
int64_t GpuModel::rank() const { return impl_->comm != nullptr ? impl_->comm->rank() : 0; }
int64_t GpuModel::world() const { return impl_->comm != nullptr ? impl_->comm->world() : 1; }
void* GpuModel::cuda_stream() const { return impl_->stream; }
bool GpuModel::fused_hc_pre() const { return impl_->fused_hc_pre; }

int64_t GpuModel::Position(int64_t slot) const {
  if (slot < 0 || slot >= impl_->options.slots) return -1;
  return impl_->slot_positions[static_cast<size_t>(slot)];
}

namespace {

absl::Status CheckTokens(const ModelConfig& c, const std::vector<int32_t>& tokens) {
  for (int32_t id : tokens) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("GpuModel: token id ", id, " outside [0, ", c.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGroupRows(int64_t group_rows, int64_t max_rows) {
  if (group_rows < 0 || group_rows > max_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: group_rows ", group_rows, " outside [0, ", max_rows, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Tensor> GpuModel::Forward(int64_t slot, const std::vector<int32_t>& tokens,
                                         int64_t group_rows, ChunkLogits rows) {
  PDSERVE_RETURN_IF_ERROR(BeginForward(slot, tokens, group_rows, rows));
  return impl_->Finish();
}

absl::StatusOr<Tensor> GpuModel::FinishForward() { return impl_->Finish(); }

ChunkLogits ServingChunkLogits() {
  return kernels::ReadSwitch("PDSERVE_GPU_CHUNK_LOGITS",
                             {{"last", ChunkLogits::kLastRow}, {"all", ChunkLogits::kAllRows}},
                             ChunkLogits::kLastRow, "the default, last");
}

absl::Status GpuModel::BeginForward(int64_t slot, const std::vector<int32_t>& tokens,
                                    int64_t group_rows, ChunkLogits logit_rows) {
  Impl& m = *impl_;
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0 || n > m.options.max_chunk) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: chunk of ", n, " tokens outside [1, ", m.options.max_chunk, "]"));
  }
  PDSERVE_RETURN_IF_ERROR(CheckTokens(m.config, tokens));
  PDSERVE_RETURN_IF_ERROR(CheckGroupRows(group_rows, m.max_rows));
  if (m.slot_positions[static_cast<size_t>(slot)] + n > m.max_context) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: context past max_context ", m.max_context));
  }
  const int64_t rows = std::max(n, group_rows);
  return m.Begin({{slot, tokens}}, rows, /*use_graph=*/false, n == 1 && m.IsBucket(rows),
                 /*to_host=*/true, logit_rows == ChunkLogits::kLastRow);
}

absl::Status GpuModel::Idle(int64_t rows) {
  Impl& m = *impl_;
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  if (rows < 1) return absl::InvalidArgumentError("GpuModel: Idle needs at least one row");
  PDSERVE_RETURN_IF_ERROR(CheckGroupRows(rows, m.max_rows));
  return m.Run({}, rows, /*use_graph=*/false, m.IsBucket(rows)).status();
}

absl::StatusOr<Tensor> GpuModel::DecodeStep(const std::vector<int64_t>& slots,
                                            const std::vector<int32_t>& tokens, bool use_graph,
                                            int64_t group_rows) {
  return impl_->Decode(slots, tokens, use_graph, group_rows, /*to_host=*/true);
}

absl::StatusOr<GpuModel::DeviceLogits> GpuModel::DecodeStepOnDevice(
    const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens, bool use_graph,
    int64_t group_rows) {
  Impl& m = *impl_;
  PDSERVE_RETURN_IF_ERROR(
      m.Decode(slots, tokens, use_graph, group_rows, /*to_host=*/false).status());
  return DeviceLogits{m.logits.get(), static_cast<int64_t>(slots.size()), m.config.vocab_size,
                      m.stream};
}

absl::StatusOr<Tensor> GpuModel::Impl::Decode(const std::vector<int64_t>& slots,
                                              const std::vector<int32_t>& tokens, bool use_graph,
                                              int64_t group_rows, bool to_host) {
  Impl& m = *this;
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  if (slots.size() != tokens.size() || (slots.empty() && group_rows <= 0)) {
    return absl::InvalidArgumentError("GpuModel: DecodeStep needs one token per slot");
  }
  PDSERVE_RETURN_IF_ERROR(CheckGroupRows(group_rows, m.max_rows));
  const int64_t batch = std::max(static_cast<int64_t>(slots.size()), group_rows);
  const auto bucket =
      std::lower_bound(m.options.decode_buckets.begin(), m.options.decode_buckets.end(), batch);
  if (bucket == m.options.decode_buckets.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: batch ", batch, " above the largest bucket"));
  }
  PDSERVE_RETURN_IF_ERROR(CheckTokens(m.config, tokens));
  std::vector<std::pair<int64_t, std::vector<int32_t>>> work;
  std::vector<bool> seen(static_cast<size_t>(m.options.slots), false);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= m.options.slots || seen[static_cast<size_t>(s)]) {
      return absl::InvalidArgumentError(absl::StrCat("GpuModel: bad or repeated slot ", s));
    }
    seen[static_cast<size_t>(s)] = true;
    if (m.slot_positions[static_cast<size_t>(s)] + 1 > m.max_context) {
      return absl::InvalidArgumentError(
          absl::StrCat("GpuModel: slot ", s, " past max_context ", m.max_context));
    }
    work.push_back({s, {tokens[i]}});
  }
  // The local communicator's host barrier would not run at a graph's replay.
  const bool graph = use_graph && (m.comm == nullptr || m.comm->graph_capturable());
  return m.Run(work, *bucket, graph, /*decode=*/true, to_host);
}

}  // namespace pdserve::engine::gpu
