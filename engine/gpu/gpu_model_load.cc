#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/gpu_model_impl.h"
#include "engine/quant.h"
#include "engine/stored_experts.h"
#include "engine/stored_fp8.h"
#include "spdlog/spdlog.h"

namespace pdserve::engine::gpu {

namespace {

// Calls put(i, expert) for the rank's experts [shard.first, shard.first + shard.count) of
// `canonical` as FP8 blocks (engine/stored_experts.h: FP4 converted, FP8 copied, on the host), by
// a few threads with `device` current, so the host holds threads x one expert at a time. Each
// expert is checked to be [n, k] with its scales first. put must be safe to call concurrently
// for different i.
absl::Status ForEachStoredExpert(
    const StoredExperts& stored, const std::string& canonical, ExpertShard shard, int device,
    int64_t n, int64_t k, const std::function<absl::Status(int64_t, const Fp8Blocks&)>& put) {
  const int64_t scales_per = (n + kFp8BlockRows - 1) / kFp8BlockRows * (k / kFp8BlockCols);
  std::atomic<int64_t> next{0};
  std::mutex mu;
  absl::Status status;
  auto work = [&] {
    absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
    for (int64_t i = next++; s.ok() && i < shard.count; i = next++) {
      absl::StatusOr<Fp8Blocks> e = stored.Expert(canonical, shard.first + i);
      if (!e.ok()) {
        s = e.status();
        break;
      }
      if (e->weight.size() != static_cast<size_t>(n * k) ||
          e->scales.size() != static_cast<size_t>(scales_per)) {
        s = absl::InternalError(absl::StrCat(canonical, ": expert ", shard.first + i, " is [",
                                             e->rows, ", ", e->cols, "], expected [", n, ", ", k,
                                             "]"));
        break;
      }
      s = put(i, *e);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (status.ok()) status = s;
  };
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1,
                                              std::min<int64_t>(16, shard.count));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& th : pool) th.join();
  return status;
}

// The experts as FP8 on the device: w [count, n, k] e4m3, scales beside them (ExpertsFp8).
absl::Status UploadStoredExperts(const StoredExperts& stored, const std::string& canonical,
                                 ExpertShard shard, int device, int64_t n, int64_t k,
                                 ExpertsFp8* d) {
  d->count = shard.count;
  d->n = n;
  d->k = k;
  const int64_t scales_per = (n + kFp8BlockRows - 1) / kFp8BlockRows * (k / kFp8BlockCols);
  PDSERVE_RETURN_IF_ERROR(d->w.Allocate(static_cast<size_t>(shard.count * n * k)));
  PDSERVE_RETURN_IF_ERROR(d->scale.Allocate(static_cast<size_t>(shard.count * scales_per)));
  return ForEachStoredExpert(
      stored, canonical, shard, device, n, k, [&](int64_t i, const Fp8Blocks& e) {
        PDSERVE_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(d->w.get() + i * n * k, e.weight.data(),
                                                      e.weight.size(), cudaMemcpyHostToDevice),
                                           "cudaMemcpy"));
        return CudaStatus(cudaMemcpy(d->scale.get() + i * scales_per, e.scales.data(),
                                     e.scales.size() * sizeof(float), cudaMemcpyHostToDevice),
                          "cudaMemcpy");
      });
}

// WeightFormat::kBf16Dequantized: the same experts dequantized on the host (value = e4m3 x its
// block's scale, then rounded to bf16) into the bf16 layout [count, n, k] that UploadBf16Rows
// gives kBf16.
absl::Status UploadStoredExpertsBf16(const StoredExperts& stored, const std::string& canonical,
                                     ExpertShard shard, int device, int64_t n, int64_t k,
                                     DeviceArray<bf16>* d) {
  PDSERVE_RETURN_IF_ERROR(d->Allocate(static_cast<size_t>(shard.count * n * k)));
  return ForEachStoredExpert(
      stored, canonical, shard, device, n, k, [&](int64_t i, const Fp8Blocks& e) {
        std::vector<float> values(static_cast<size_t>(n * k));
        DequantizeFp8(e.weight.data(), n, k, e.scales.data(), values.data());
        std::vector<bf16> rounded(values.size());
        for (size_t j = 0; j < values.size(); ++j) rounded[j] = __float2bfloat16_rn(values[j]);
        return CudaStatus(cudaMemcpy(d->get() + i * n * k, rounded.data(),
                                     rounded.size() * sizeof(bf16), cudaMemcpyHostToDevice),
                          "cudaMemcpy");
      });
}

}  // namespace

absl::Status LinearSource::Load(const std::string& name, Linear* d, int64_t row_group) const {
  if (fp8 != nullptr && fp8->Has(name)) {
    PDSERVE_ASSIGN_OR_RETURN(StoredFp8Matrix m, fp8->Get(name));
    if (dequantize) {
      Tensor t({m.rows, m.cols});
      t.data = DequantizeStored(m);
      fp8->Release(name);
      return UploadLinear(t, fp32, d);
    }
    if (m.cols % kFp8BlockCols == 0 && m.rows > 0 && row_group % kFp8BlockRows == 0) {
      d->out = m.rows;
      d->in = m.cols;
      PDSERVE_RETURN_IF_ERROR(d->fp8.Upload(m.weight.data(), m.weight.size()));
      fp8->Release(name);
      return d->fp8_scale.Upload(m.scales);
    }
    if (logged->insert(WithoutLayer(name)).second) {
      spdlog::warn(
          "weights fp8: {} is [{}, {}] in row groups of {}: fp8_gemm needs the input width and "
          "the groups multiples of {}; bf16 on the GPU",
          WithoutLayer(name), m.rows, m.cols, row_group, kFp8BlockCols);
    }
    Tensor t({m.rows, m.cols});
    t.data = DequantizeStored(m);
    return UploadLinear(t, fp32, d);
  }
  if (fp8 != nullptr && !dequantize && logged->insert(WithoutLayer(name)).second) {
    spdlog::info("weights fp8: {} is not stored FP8 with block scales: bf16 on the GPU",
                 WithoutLayer(name));
  }
  PDSERVE_ASSIGN_OR_RETURN(const Tensor* t, weights->Get(name));
  return UploadLinear(*t, fp32, d);
}

absl::Status GpuModel::Impl::Load(const Weights& w) {
  const ModelConfig& c = config;
  const int64_t slots = options.slots + 1;
  const bool fp32 = options.gemm_inputs == GemmInputs::kFp32;
  std::optional<StoredFp8Weights> stored;
  std::optional<StoredExperts> stored_experts;
  std::set<std::string> logged;
  LinearSource src{&w, fp32, nullptr, &logged};
  if (options.weight_format == WeightFormat::kFp8Block ||
      options.weight_format == WeightFormat::kBf16Dequantized) {
    PDSERVE_ASSIGN_OR_RETURN(stored, StoredFp8Weights::Open(options.checkpoint_dir));
    src.fp8 = &*stored;
    src.dequantize = options.weight_format == WeightFormat::kBf16Dequantized;
    PDSERVE_ASSIGN_OR_RETURN(stored_experts, StoredExperts::Open(options.checkpoint_dir, c));
  }
  PDSERVE_RETURN_IF_ERROR(UploadBf16(w.At("model.embed_tokens.weight"), &embed));
  auto lm = w.Get("lm_head.weight");
  PDSERVE_RETURN_IF_ERROR(
      UploadLinear(lm.ok() ? **lm : w.At("model.embed_tokens.weight"), fp32, &lm_head));
  PDSERVE_RETURN_IF_ERROR(UploadF32(w.At("model.norm.weight"), &final_norm));
  PDSERVE_RETURN_IF_ERROR(head_hc.Load(w, "model.hc_head", ".hc_fn", ".hc_base", ".hc_scale"));
  PDSERVE_RETURN_IF_ERROR(main_inv_freq.Upload(main_rope.inv_freq()));
  PDSERVE_RETURN_IF_ERROR(compress_inv_freq.Upload(compress_rope.inv_freq()));
  layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& layer = layers[static_cast<size_t>(l)];
    const std::string p = absl::StrCat("model.layers.", l);
    const std::string a = AttnPrefix(l);
    layer.type = c.layer_types[static_cast<size_t>(l)];
    const bool sliding = layer.type == LayerType::kSlidingAttention;
    layer.rope = sliding ? &main_rope : &compress_rope;
    layer.inv_freq = sliding ? &main_inv_freq : &compress_inv_freq;
    PDSERVE_RETURN_IF_ERROR(layer.attn_hc.Load(w, p + ".attn_hc", ".fn", ".base", ".scale"));
    PDSERVE_RETURN_IF_ERROR(layer.ffn_hc.Load(w, p + ".ffn_hc", ".fn", ".base", ".scale"));
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(p + ".input_layernorm.weight"), &layer.input_norm));
    PDSERVE_RETURN_IF_ERROR(
        UploadF32(w.At(p + ".post_attention_layernorm.weight"), &layer.post_attention_norm));
    bool attn_fused = false;
    bool ffn_fused = false;
    PDSERVE_RETURN_IF_ERROR(LoadFusedGroups(src, l, &layer, &attn_fused, &ffn_fused));
    if (!attn_fused) PDSERVE_RETURN_IF_ERROR(src.Load(a + ".q_a_proj.weight", &layer.q_a_proj));
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(a + ".q_a_norm.weight"), &layer.q_a_norm));
    PDSERVE_RETURN_IF_ERROR(src.Load(a + ".q_b_proj.weight", &layer.q_b_proj));
    if (!attn_fused) PDSERVE_RETURN_IF_ERROR(src.Load(a + ".kv_proj.weight", &layer.kv_proj));
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(a + ".kv_norm.weight"), &layer.kv_norm));
    PDSERVE_RETURN_IF_ERROR(src.Load(a + ".o_a_proj.weight", &layer.o_a_proj, c.o_lora_rank));
    PDSERVE_RETURN_IF_ERROR(src.Load(a + ".o_b_proj.weight", &layer.o_b_proj));
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(a + ".sinks"), &layer.sinks));
    PDSERVE_RETURN_IF_ERROR(
        layer.window_ring.Allocate(static_cast<size_t>(slots * c.sliding_window * c.head_dim)));
    const int64_t rate = sliding ? 1 : c.CompressRate(layer.type);
    const std::string comp = a + ".compressor";
    if (!sliding) {
      layer.has_compressor = true;
      const bool csa = layer.type == LayerType::kCompressedSparseAttention;
      const int64_t kind = kind_of_rate.at(rate);
      const int64_t device_pages = pages->device_pages(kind);
      PDSERVE_RETURN_IF_ERROR(layer.compressor.Load(src, comp, c.head_dim, rate, csa, slots,
                                                    max_context, kind, device_pages, attn_fused));
      if (csa) {
        layer.has_indexer = true;
        PDSERVE_RETURN_IF_ERROR(
            layer.indexer_compressor.Load(src, comp + ".indexer", c.index_head_dim, rate, true,
                                          slots, max_context, kind, device_pages, attn_fused));
        PDSERVE_RETURN_IF_ERROR(
            src.Load(comp + ".indexer.q_b_proj.weight", &layer.indexer_q_b_proj));
        if (!attn_fused) {
          PDSERVE_RETURN_IF_ERROR(
              src.Load(comp + ".indexer.scorer.weights_proj.weight", &layer.indexer_weights_proj));
        }
      }
    }
    const std::string m = p + ".mlp";
    layer.hash = c.mlp_layer_types[static_cast<size_t>(l)] == MlpLayerType::kHashMoe;
    PDSERVE_RETURN_IF_ERROR(UploadF32(w.At(m + ".gate.weight"), &layer.gate));
    if (layer.hash) {
      const Tensor& t = w.At(m + ".gate.tid2eid");
      std::vector<int32_t> ids(t.data.size());
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(t.data[i]);
      PDSERVE_RETURN_IF_ERROR(layer.tid2eid.Upload(ids));
    } else {
      PDSERVE_RETURN_IF_ERROR(
          UploadF32(w.At(m + ".gate.e_score_correction_bias"), &layer.correction_bias));
    }
    PDSERVE_RETURN_IF_ERROR(
        LoadRoutedExperts(w, stored_experts ? &*stored_experts : nullptr, m + ".experts", &layer));
    if (!ffn_fused) {
      PDSERVE_RETURN_IF_ERROR(src.Load(m + ".shared_experts.gate_proj.weight", &layer.shared_gate));
      PDSERVE_RETURN_IF_ERROR(src.Load(m + ".shared_experts.up_proj.weight", &layer.shared_up));
    }
    PDSERVE_RETURN_IF_ERROR(src.Load(m + ".shared_experts.down_proj.weight", &layer.shared_down));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::LoadRoutedExperts(const Weights& w, const StoredExperts* stored,
                                               const std::string& prefix, Layer* layer) {
  const ModelConfig& c = config;
  const std::string gate_up = prefix + ".gate_up_proj";
  const std::string down = prefix + ".down_proj";
  const bool fp8 = stored != nullptr && stored->Has(gate_up) && stored->Has(down) &&
                   c.hidden_size % kFp8BlockCols == 0 &&
                   c.moe_intermediate_size % kFp8BlockCols == 0;
  if (fp8 && options.weight_format == WeightFormat::kBf16Dequantized) {
    PDSERVE_RETURN_IF_ERROR(UploadStoredExpertsBf16(*stored, gate_up, shard, options.device,
                                                    2 * c.moe_intermediate_size, c.hidden_size,
                                                    &layer->gate_up));
    return UploadStoredExpertsBf16(*stored, down, shard, options.device, c.hidden_size,
                                   c.moe_intermediate_size, &layer->down);
  }
  if (fp8) {
    const kc::ExpertFormat format = options.fp8_activations == Fp8Activations::kBf16
                                        ? kc::ExpertFormat::kFp8W8A16
                                        : kc::ExpertFormat::kFp8;
    layer->gate_up8.format = format;
    layer->down8.format = format;
    PDSERVE_RETURN_IF_ERROR(UploadStoredExperts(*stored, gate_up, shard, options.device,
                                                2 * c.moe_intermediate_size, c.hidden_size,
                                                &layer->gate_up8));
    return UploadStoredExperts(*stored, down, shard, options.device, c.hidden_size,
                               c.moe_intermediate_size, &layer->down8);
  }
  if (stored != nullptr && !w.Get(gate_up).ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(gate_up,
                     ": left in the checkpoint by the loader but not stored as FP8 / FP4 experts "
                     "moe_gemm can take (hidden and moe_intermediate_size multiples of 128)"));
  }
  if (options.weight_format == WeightFormat::kFp8Block && logged_bf16_experts++ == 0) {
    spdlog::info("weights fp8: routed experts are not stored FP8 / FP4: bf16 on the GPU");
  }
  // The rank's block of routed experts (all of them without a group).
  PDSERVE_RETURN_IF_ERROR(UploadBf16Rows(w.At(gate_up), shard.first, shard.count, &layer->gate_up));
  return UploadBf16Rows(w.At(down), shard.first, shard.count, &layer->down);
}

absl::Status GpuModel::Impl::AllocateFp8Experts() {
  const ModelConfig& c = config;
  bool any = false;
  for (const Layer& l : layers) any = any || l.gate_up8.present();
  if (!any) return absl::OkStatus();
  const int64_t world = comm != nullptr ? comm->world() : 1;
  const int64_t rows = world * max_rows;
  const int64_t k = c.num_experts_per_tok;
  const auto n_picks = static_cast<size_t>(rows * k);
  PDSERVE_RETURN_IF_ERROR(moe_gate_up.Allocate(n_picks * 2 * c.moe_intermediate_size));
  PDSERVE_RETURN_IF_ERROR(moe_act.Allocate(n_picks * c.moe_intermediate_size));
  PDSERVE_RETURN_IF_ERROR(moe_down.Allocate(n_picks * c.hidden_size));
  size_t workspace = 0;
  for (const Layer& l : layers) {
    if (!l.gate_up8.present()) continue;
    // Not monotonic in the row count in general: every size a call can have.
    for (int64_t t = 1; t <= rows; ++t) {
      workspace =
          std::max({workspace, kc::moe_grouped_gemm_workspace_bytes(t, k, t, l.gate_up8.View()),
                    kc::moe_grouped_gemm_workspace_bytes(t, k, t * k, l.down8.View())});
    }
    break;  // every layer's experts have the same shape
  }
  return moe_gemm_workspace.Allocate(std::max<size_t>(workspace, 256));
}

absl::Status GpuModel::Impl::AllocateFp8() {
  size_t workspace = 0;
  const int64_t groups = config.o_groups;
  const bool shared_act_quant = SharedActQuantWanted();
  std::set<std::pair<int64_t, int64_t>> shapes;  // [n, k] of each FP8 projection's calls
  for (const Layer& l : layers) {
    for (const Linear* w :
         {&l.q_a_proj, &l.q_b_proj, &l.kv_proj, &l.o_a_proj, &l.o_b_proj, &l.compressor.kv_proj,
          &l.compressor.gate_proj, &l.indexer_compressor.kv_proj, &l.indexer_compressor.gate_proj,
          &l.indexer_q_b_proj, &l.indexer_weights_proj, &l.shared_gate, &l.shared_up,
          &l.shared_down, &l.attn_in, &l.ffn_in}) {
      // A fused part runs inside its group's GEMM.
      if (!w->is_fp8() || w->fused()) continue;
      // o_a runs per group: [out / groups, in] blocks of its rows.
      shapes.insert({w == &l.o_a_proj ? w->out / groups : w->out, w->in});
    }
  }
  if (shapes.empty()) return absl::OkStatus();
  // Every call of 1 .. max_rows rows, fp8_gemm's, fp8_gemm_w8a16's (not covered by fp8_gemm's at
  // every size: PDSERVE_FP8_GEMM=wgmma, 65-128 rows, n in [16833, 22528]) and with the shared act
  // quant fp8_gemm_quantized's: kernels/cuda/fp8_gemm_workspace.h, the formula the memory plan
  // counts (engine/gpu_workspace_plan.h), here with this process's PDSERVE_FP8_GEMM and
  // PDSERVE_FP8_WGMMA.
  for (const auto& [n, k] : shapes) {
    workspace =
        std::max(workspace, kc::fp8_workspace::ProjectionBytes(
                                max_rows, n, k, shared_act_quant, kc::fp8_gemm_forced_path(),
                                kc::fp8_gemm_wgmma_default_config()));
  }
  // W8A8 runs cuBLASLt from kFp8LtMinTokens rows (decode graphs included): its handle now,
  // not inside a capture. Without one fp8_gemm uses its own kernels.
  if (options.fp8_activations != Fp8Activations::kBf16) (void)kc::fp8_gemm_prepare();
  PDSERVE_RETURN_IF_ERROR(AllocateSharedActQuant());
  return fp8_workspace.Allocate(std::max<size_t>(workspace, 256));
}

absl::Status GpuModel::Impl::Allocate() {
  const ModelConfig& c = config;
  const auto r = static_cast<size_t>(max_rows);
  const auto hidden = static_cast<size_t>(c.hidden_size);
  const auto hc = static_cast<size_t>(c.hc_mult);
  const auto heads_hd = static_cast<size_t>(c.num_attention_heads * c.head_dim);
  const auto hd = static_cast<size_t>(c.head_dim);
  const auto inter = static_cast<size_t>(c.moe_intermediate_size);
  const auto k = static_cast<size_t>(c.num_experts_per_tok);
  size_t width = 2 * std::max(hd, static_cast<size_t>(c.index_head_dim));
  size_t idx_cap = 1;
  for (const Layer& l : layers) {
    if (l.has_indexer)
      idx_cap = std::max(idx_cap, static_cast<size_t>(l.indexer_compressor.capacity));
  }
  PDSERVE_RETURN_IF_ERROR(streams.Allocate(r * hc * hidden));
  PDSERVE_RETURN_IF_ERROR(flat.Allocate(r * hc * hidden));
  PDSERVE_RETURN_IF_ERROR(mix.Allocate(r * (2 + hc) * hc));
  PDSERVE_RETURN_IF_ERROR(post.Allocate(r * hc));
  PDSERVE_RETURN_IF_ERROR(comb.Allocate(r * hc * hc));
  PDSERVE_RETURN_IF_ERROR(collapsed.Allocate(r * hidden));
  PDSERVE_RETURN_IF_ERROR(sub_out.Allocate(r * hidden));
  PDSERVE_RETURN_IF_ERROR(x_bf.Allocate(r * std::max(hidden, inter)));
  PDSERVE_RETURN_IF_ERROR(q_res.Allocate(r * c.q_lora_rank));
  PDSERVE_RETURN_IF_ERROR(q_res_bf.Allocate(r * c.q_lora_rank));
  PDSERVE_RETURN_IF_ERROR(q.Allocate(r * heads_hd));
  PDSERVE_RETURN_IF_ERROR(kv.Allocate(r * hd));
  PDSERVE_RETURN_IF_ERROR(new_kv.Allocate(r * hd));
  PDSERVE_RETURN_IF_ERROR(attn.Allocate(r * heads_hd));
  PDSERVE_RETURN_IF_ERROR(attn_bf.Allocate(r * heads_hd));
  PDSERVE_RETURN_IF_ERROR(grouped.Allocate(r * c.o_groups * c.o_lora_rank));
  PDSERVE_RETURN_IF_ERROR(grouped_bf.Allocate(r * c.o_groups * c.o_lora_rank));
  PDSERVE_RETURN_IF_ERROR(comp_kv.Allocate(r * width));
  PDSERVE_RETURN_IF_ERROR(comp_gate.Allocate(r * width));
  PDSERVE_RETURN_IF_ERROR(idx_q.Allocate(r * c.index_n_heads * c.index_head_dim));
  PDSERVE_RETURN_IF_ERROR(idx_w.Allocate(r * c.index_n_heads));
  PDSERVE_RETURN_IF_ERROR(idx_scores.Allocate(r * idx_cap));
  PDSERVE_RETURN_IF_ERROR(idx_visible.Allocate(r));
  PDSERVE_RETURN_IF_ERROR(picks.Allocate(r * std::max<int64_t>(1, c.index_topk)));
  PDSERVE_RETURN_IF_ERROR(sh_gate.Allocate(r * inter));
  PDSERVE_RETURN_IF_ERROR(sh_up.Allocate(r * inter));
  PDSERVE_RETURN_IF_ERROR(act_bf.Allocate(r * inter));
  PDSERVE_RETURN_IF_ERROR(router_logits.Allocate(r * c.n_routed_experts));
  PDSERVE_RETURN_IF_ERROR(route_experts.Allocate(r * k));
  PDSERVE_RETURN_IF_ERROR(route_weights.Allocate(r * k));
  // An expert-parallel rank runs its experts over the whole group's rows.
  const int64_t world = comm != nullptr ? comm->world() : 1;
  PDSERVE_RETURN_IF_ERROR(moe_workspace.Allocate(
      std::max<size_t>(1, kc::moe_experts_workspace_bytes(world * max_rows, c.num_experts_per_tok,
                                                          c.moe_intermediate_size))));
  if (comm != nullptr) {
    const auto all = static_cast<size_t>(world) * r;
    PDSERVE_RETURN_IF_ERROR(ep_x.Allocate(all * hidden));
    PDSERVE_RETURN_IF_ERROR(ep_experts.Allocate(all * k));
    PDSERVE_RETURN_IF_ERROR(ep_weights.Allocate(all * k));
    PDSERVE_RETURN_IF_ERROR(ep_out.Allocate(all * hidden));
    PDSERVE_RETURN_IF_ERROR(ep_reduced.Allocate(r * hidden));
  }
  PDSERVE_RETURN_IF_ERROR(logits.Allocate(r * c.vocab_size));
  PDSERVE_RETURN_IF_ERROR(AllocateFp8());
  PDSERVE_RETURN_IF_ERROR(AllocateFp8Experts());
  PDSERVE_RETURN_IF_ERROR(AllocateFused());
  size_t max_capacity = kPageSize;
  for (const Layer& l : layers) {
    if (l.has_compressor) max_capacity = std::max<size_t>(max_capacity, l.compressor.capacity);
  }
  max_capacity = std::max(max_capacity, idx_cap);
  PDSERVE_RETURN_IF_ERROR(window_len.Allocate(r));
  PDSERVE_RETURN_IF_ERROR(n_compressed.Allocate(r));
  PDSERVE_RETURN_IF_ERROR(page_table.Allocate(r * (max_capacity / kPageSize)));
  if (fast_attention) {
    PDSERVE_RETURN_IF_ERROR(q_bf.Allocate(r * heads_hd));
    size_t bytes = 1;
    for (int64_t batch : options.decode_buckets) {
      for (const Layer& l : layers) bytes = std::max(bytes, DecodeWorkspace(l, batch));
    }
    PDSERVE_RETURN_IF_ERROR(attn_workspace.Allocate(bytes));
  }
  if (fast_indexer) {
    PDSERVE_RETURN_IF_ERROR(idx_q_bf.Allocate(r * c.index_n_heads * c.index_head_dim));
  }
  PDSERVE_RETURN_IF_ERROR(rows_meta.Allocate(r * kRowFields));
  PDSERVE_RETURN_IF_ERROR(seg_meta.Allocate(r * kSegFields));
  PDSERVE_RETURN_IF_ERROR(rows_host.Allocate(r * kRowFields));
  PDSERVE_RETURN_IF_ERROR(seg_host.Allocate(r * kSegFields));
  PDSERVE_RETURN_IF_ERROR(logits_host.Allocate(r * c.vocab_size));
  // cuBLAS gets a fixed workspace so eager and captured launches choose the same algorithms.
  PDSERVE_RETURN_IF_ERROR(cublas_workspace.Allocate(size_t{32} << 20));
  PDSERVE_CUBLAS_RETURN(
      cublasSetWorkspace(cublas, cublas_workspace.get(), cublas_workspace.size()));
  return absl::OkStatus();
}

GpuModel::GpuModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuModel::~GpuModel() = default;

absl::StatusOr<std::unique_ptr<GpuModel>> GpuModel::Create(const ModelConfig& config,
                                                           const Weights& weights,
                                                           GpuModelOptions options) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("GpuModel: no CUDA device");
  }
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: device ", options.device, " outside [0, ", devices, ")"));
  }
  if (options.slots <= 0 || options.max_chunk <= 0) {
    return absl::InvalidArgumentError("GpuModel: slots and max_chunk must be positive");
  }
  if (options.state_tokens < 0 || (!options.paged_state && options.state_tokens != 0)) {
    return absl::InvalidArgumentError(
        "GpuModel: state_tokens must be >= 0, and 0 without paged_state");
  }
  if (options.weight_format == WeightFormat::kFp8Block &&
      (options.gemm_inputs != GemmInputs::kBf16 || options.checkpoint_dir.empty())) {
    return absl::InvalidArgumentError(
        "GpuModel: FP8 weights need bf16 GEMM inputs and the checkpoint directory");
  }
  if (options.weight_format == WeightFormat::kBf16Dequantized && options.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "GpuModel: weights dequantized from the checkpoint need the checkpoint directory");
  }
  if (options.fp8_activations != Fp8Activations::kBf16 &&
      options.fp8_activations != Fp8Activations::kFp8) {
    return absl::InvalidArgumentError("GpuModel: fp8_activations: neither kBf16 nor kFp8");
  }
  std::vector<int64_t>& buckets = options.decode_buckets;
  if (buckets.empty()) {
    for (int64_t b = 1; b < options.slots; b *= 2) buckets.push_back(b);
  }
  buckets.erase(
      std::remove_if(buckets.begin(), buckets.end(), [&](int64_t b) { return b >= options.slots; }),
      buckets.end());
  buckets.push_back(options.slots);
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  if (buckets.front() <= 0) {
    return absl::InvalidArgumentError("GpuModel: decode buckets must be positive");
  }
  const int64_t max_context = options.max_context > 0
                                  ? options.max_context
                                  : std::min<int64_t>(config.max_position_embeddings, 4096);
  if (max_context > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("GpuModel: max_context ", max_context,
                                                   " > max_position_embeddings ",
                                                   config.max_position_embeddings));
  }
  if (config.index_topk > kc::kMaxTopK) {
    return absl::InvalidArgumentError("GpuModel: index_topk above the top-k kernel's bound");
  }
  ExpertShard shard{0, config.n_routed_experts};
  if (options.expert_comm != nullptr) {
    const ExpertComm& comm = *options.expert_comm;
    if (comm.device() != options.device) {
      return absl::InvalidArgumentError(absl::StrCat("GpuModel: expert communicator on device ",
                                                     comm.device(), ", model on device ",
                                                     options.device));
    }
    PDSERVE_ASSIGN_OR_RETURN(shard,
                             ExpertShardOf(config.n_routed_experts, comm.world(), comm.rank()));
  }
  PDSERVE_CUDA_RETURN(cudaSetDevice(options.device));
  auto impl = std::make_unique<Impl>(config, options);
  impl->max_context = max_context;
  impl->comm = options.expert_comm;
  impl->shard = shard;
  impl->geometry = RingGeometryFor(config, max_context, kPageSize);
  impl->max_rows = std::max(options.max_chunk, options.decode_buckets.back());
  impl->scratch_slot = options.slots;
  impl->slot_positions.assign(static_cast<size_t>(options.slots + 1), 0);
  PDSERVE_CUDA_RETURN(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  PDSERVE_CUBLAS_RETURN(cublasCreate(&impl->cublas));
  PDSERVE_CUBLAS_RETURN(cublasSetStream(impl->cublas, impl->stream));
  impl->fused = FusedProjectionsWanted(options);
  PDSERVE_RETURN_IF_ERROR(impl->MakePages());
  PDSERVE_RETURN_IF_ERROR(impl->Load(weights));
  impl->fast_attention = options.fixed_shape_attention && config.head_dim == kc::kSparseHeadDim &&
                         config.num_attention_heads % kc::kSparseHeadsPerBlock == 0;
  impl->fast_indexer = options.fixed_shape_indexer && config.index_n_heads == kc::kIndexHeads &&
                       config.index_head_dim == kc::kIndexHeadDim;
  PDSERVE_CUDA_RETURN(
      cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, options.device));
  PDSERVE_RETURN_IF_ERROR(impl->Allocate());
  impl->EnableFusedHcPre();
  // State pools start as NaN (all bits set): a kernel that read a slot's never-written row
  // would turn that request's logits into NaN, which the tests would see.
  for (Layer& layer : impl->layers) {
    PDSERVE_RETURN_IF_ERROR(layer.window_ring.Fill(0xFF));
    for (CompressorWeights* cw : {&layer.compressor, &layer.indexer_compressor}) {
      PDSERVE_RETURN_IF_ERROR(cw->ring_kv.Fill(0xFF));
      PDSERVE_RETURN_IF_ERROR(cw->ring_gate.Fill(0xFF));
      PDSERVE_RETURN_IF_ERROR(cw->entries.Fill(0xFF));
    }
  }
  PDSERVE_CUDA_RETURN(cudaDeviceSynchronize());
  return std::unique_ptr<GpuModel>(new GpuModel(std::move(impl)));
}

}  // namespace pdserve::engine::gpu
