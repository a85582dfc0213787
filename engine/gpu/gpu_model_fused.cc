// GpuModelOptions::fused_projections (engine/fused_projections.h): loading a layer's projection
// groups stacked into one weight each, the fused buffers, and FP8 o_a's groups as one grouped
// GEMM. The forward pass reads the groups in gpu_model.cc (Attention, Moe). Not thread-safe, as
// GpuModel.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/fused_projections.h"
#include "engine/gpu/gpu_model_impl.h"
#include "engine/quant.h"
#include "engine/stored_fp8.h"
#include "kernels/env_switch.h"
#include "spdlog/spdlog.h"

namespace pdserve::engine::gpu {

bool FusedProjectionsWanted(const GpuModelOptions& options) {
  const bool wanted = kernels::ReadSwitchOverride("PDSERVE_FUSED_PROJECTIONS",
                                                  "the option (GpuModelOptions::fused_projections)")
                          .value_or(options.fused_projections);
  if (wanted && options.gemm_inputs == GemmInputs::kFp32) {
    spdlog::info("fused projections: off with fp32 GEMM inputs");
    return false;
  }
  spdlog::debug("fused projections: {}", wanted ? "on" : "off");
  return wanted;
}

HcPreSwitch HcPreSwitchFromEnv() {
  return kernels::ReadSwitch(
      "PDSERVE_FUSED_HC_PRE",
      {{"0", HcPreSwitch::kOff}, {"1", HcPreSwitch::kOn}, {"pdl", HcPreSwitch::kPdl}},
      HcPreSwitch::kOption, "the option (GpuModelOptions::fused_hc_pre)");
}

bool FusedHcPreWanted(const GpuModelOptions& options, HcPreSwitch forced) {
  return forced == HcPreSwitch::kOn || forced == HcPreSwitch::kPdl ||
         (forced == HcPreSwitch::kOption && options.fused_hc_pre);
}

void GpuModel::Impl::EnableFusedHcPre() {
  fused_hc_pre = false;
  const HcPreSwitch forced = HcPreSwitchFromEnv();
  if (!FusedHcPreWanted(options, forced)) return;
  const ModelConfig& c = config;
  bool shapes = kc::hyper_connection_pre_fused_workspace(max_rows, c.hc_mult, c.hidden_size) <=
                static_cast<int64_t>(flat.size());
  for (const Layer& l : layers) {
    for (const HcWeights* hc : {&l.attn_hc, &l.ffn_hc}) {
      shapes =
          shapes && kc::hyper_connection_pre_fused_supports(c.hc_mult, c.hidden_size, hc->outputs);
    }
  }
  fused_hc_pre = shapes;
  hc_pre_programmatic = shapes && forced == HcPreSwitch::kPdl;
  spdlog::debug("fused hc pre: {}", shapes ? "on" : "off (shape not supported)");
}

absl::StatusOr<bool> LinearSource::LoadFused(const FusedGroupSpec& spec,
                                             const std::vector<Linear*>& parts,
                                             Linear* group) const {
  PDSERVE_ASSIGN_OR_RETURN(const FusedLayout layout, PlanFusedLayout(spec.rows, spec.cols));
  // Each part as Load would keep it: FP8 when stored so (not dequantized) with whole 128-column
  // blocks and the shape the config says, else bf16.
  std::vector<StoredFp8Matrix> stored;
  for (const std::string& name : spec.names) {
    if (fp8 == nullptr || dequantize || !fp8->Has(name)) break;
    PDSERVE_ASSIGN_OR_RETURN(StoredFp8Matrix m, fp8->Get(name));
    const size_t i = stored.size();
    if (m.rows != spec.rows[i] || m.cols != spec.cols || m.cols % kFp8BlockCols != 0) break;
    stored.push_back(std::move(m));
  }
  const bool all_fp8 = stored.size() == spec.names.size();
  const bool any_fp8 = std::any_of(spec.names.begin(), spec.names.end(), [&](const auto& name) {
    return fp8 != nullptr && !dequantize && fp8->Has(name);
  });
  if (!all_fp8 && any_fp8) {
    if (logged->insert("fused:" + WithoutLayer(spec.names[0])).second) {
      spdlog::info("fused projections: the group of {} mixes FP8 and bf16 parts: not fused",
                   WithoutLayer(spec.names[0]));
    }
    return false;
  }
  group->out = layout.rows;
  group->in = layout.cols;
  if (all_fp8) {
    std::vector<const uint8_t*> weights_of;
    std::vector<const float*> scales_of;
    for (const StoredFp8Matrix& m : stored) {
      weights_of.push_back(m.weight.data());
      scales_of.push_back(m.scales.data());
    }
    PDSERVE_RETURN_IF_ERROR(group->fp8.Upload(StackRows<uint8_t>(layout, weights_of)));
    PDSERVE_RETURN_IF_ERROR(group->fp8_scale.Upload(StackBlockScales(layout, scales_of)));
    for (const std::string& name : spec.names) fp8->Release(name);
  } else {
    // bf16: the values Load would upload (the host weights, or a stored FP8 matrix dequantized),
    // rounded per part, then stacked as 16-bit patterns.
    std::vector<std::vector<bf16>> rounded;
    for (size_t i = 0; i < spec.names.size(); ++i) {
      const std::string& name = spec.names[i];
      Tensor t;
      if (fp8 != nullptr && fp8->Has(name)) {
        PDSERVE_ASSIGN_OR_RETURN(StoredFp8Matrix m, fp8->Get(name));
        t = Tensor({m.rows, m.cols});
        t.data = DequantizeStored(m);
        fp8->Release(name);
      } else {
        PDSERVE_ASSIGN_OR_RETURN(const Tensor* held, weights->Get(name));
        t = *held;
      }
      if (t.numel() != spec.rows[i] * spec.cols) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": ", t.numel(), " values, expected [",
                                                       spec.rows[i], ", ", spec.cols, "]"));
      }
      rounded.push_back(ToBf16(t));
    }
    std::vector<const uint16_t*> bits;
    for (const std::vector<bf16>& r : rounded) {
      bits.push_back(reinterpret_cast<const uint16_t*>(r.data()));
    }
    const std::vector<uint16_t> stacked = StackRows<uint16_t>(layout, bits);
    PDSERVE_RETURN_IF_ERROR(
        group->bf.Upload(reinterpret_cast<const bf16*>(stacked.data()), stacked.size()));
  }
  const int64_t kblocks = (layout.cols + kFp8BlockCols - 1) / kFp8BlockCols;
  for (size_t i = 0; i < parts.size(); ++i) {
    Linear& part = *parts[i];
    const int64_t offset = layout.row_offset[i];
    part.out = layout.part_rows[i];
    part.in = layout.cols;
    part.fused_col = offset;
    if (all_fp8) {
      part.fp8_view = group->fp8.get() + offset * layout.cols;
      part.fp8_scale_view = group->fp8_scale.get() + offset / kFp8BlockRows * kblocks;
    } else {
      part.bf_view = group->bf.get() + offset * layout.cols;
    }
  }
  return true;
}

absl::Status GpuModel::Impl::LoadFusedGroups(const LinearSource& src, int64_t l, Layer* layer,
                                             bool* attn_fused, bool* ffn_fused) {
  *attn_fused = false;
  *ffn_fused = false;
  if (!fused) return absl::OkStatus();
  const FusedGroupSpec spec = AttentionInputGroup(config, l);
  std::vector<Linear*> attn_parts = {&layer->q_a_proj,
                                     &layer->kv_proj,
                                     &layer->compressor.kv_proj,
                                     &layer->compressor.gate_proj,
                                     &layer->indexer_compressor.kv_proj,
                                     &layer->indexer_compressor.gate_proj,
                                     &layer->indexer_weights_proj};
  attn_parts.resize(spec.names.size());
  PDSERVE_ASSIGN_OR_RETURN(*attn_fused, src.LoadFused(spec, attn_parts, &layer->attn_in));
  PDSERVE_ASSIGN_OR_RETURN(
      *ffn_fused, src.LoadFused(FfnInputGroup(config, l), {&layer->shared_gate, &layer->shared_up},
                                &layer->ffn_in));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::AllocateFused() {
  if (!fused) return absl::OkStatus();
  int64_t width = 0;
  for (const Layer& l : layers) width = std::max({width, l.attn_in.out, l.ffn_in.out});
  PDSERVE_RETURN_IF_ERROR(fused_out.Allocate(static_cast<size_t>(max_rows * width)));
  // FP8 o_a as one grouped call: moe_grouped_gemm takes up to 32 picks per row.
  const ModelConfig& c = config;
  bool fp8_o_a = false;
  for (const Layer& l : layers) fp8_o_a = fp8_o_a || l.o_a_proj.is_fp8();
  // PDSERVE_FUSED_O_A=0 keeps o_a's groups as separate calls (to tell the two fusions apart).
  const bool o_a_wanted =
      kernels::ReadSwitchFlag("PDSERVE_FUSED_O_A", true, "the default (one grouped call)");
  o_a_grouped = o_a_wanted && fp8_o_a && c.o_groups <= 32;
  if (!o_a_grouped) return absl::OkStatus();
  std::vector<int32_t> ids(static_cast<size_t>(max_rows * c.o_groups));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % c.o_groups);
  PDSERVE_RETURN_IF_ERROR(o_a_ids.Upload(ids));
  kc::ExpertWeights view;
  view.format = options.fp8_activations == Fp8Activations::kBf16 ? kc::ExpertFormat::kFp8W8A16
                                                                 : kc::ExpertFormat::kFp8;
  view.n_experts = c.o_groups;
  view.n = c.o_lora_rank;
  view.k = c.num_attention_heads * c.head_dim / c.o_groups;
  size_t bytes = 0;
  // Not monotonic in the row count in general: every size a call can have.
  for (int64_t t = 1; t <= std::min(max_rows, kOaGroupedMaxRows); ++t) {
    bytes =
        std::max(bytes, kc::moe_grouped_gemm_workspace_bytes(t, c.o_groups, t * c.o_groups, view));
  }
  return o_a_workspace.Allocate(std::max<size_t>(bytes, 256));
}

absl::Status GpuModel::Impl::GroupedOa(const Layer& layer, int64_t rows) {
  const ModelConfig& c = config;
  const int64_t groups = c.o_groups;
  const int64_t group_in = c.num_attention_heads * c.head_dim / groups;
  // Row r's pick g is "expert" g (o_a_ids) reading attn_bf's row r, columns g * group_in.. (pick
  // rows group_in apart: x_per_pick) and writing grouped_bf's row r, columns g * o_lora...
  kc::ExpertWeights w;
  w.format = options.fp8_activations == Fp8Activations::kBf16 ? kc::ExpertFormat::kFp8W8A16
                                                              : kc::ExpertFormat::kFp8;
  w.w = layer.o_a_proj.fp8_weight();
  w.scale = layer.o_a_proj.fp8_scales();
  w.n_experts = groups;
  w.n = c.o_lora_rank;
  w.k = group_in;
  std::string refusal;
  // o_a_ids is the identity routing (row r's pick g is group g): no grouping kernel, and the
  // GEMM's blocks stream their first weights while the kernel before drains.
  const cudaError_t e = kc::moe_grouped_gemm(
      attn_bf.get(), group_in, /*x_per_pick=*/true, o_a_ids.get(), /*pick_weights=*/nullptr, rows,
      groups, w, /*ue8m0_act_scale=*/false, grouped_bf.get(), c.o_lora_rank, o_a_workspace.get(),
      o_a_workspace.size(), stream, &refusal, kc::MoeMmaGrouping::kIdentity);
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("moe_grouped_gemm (o_a): ", cudaGetErrorString(e),
                                          refusal.empty() ? "" : ": ", refusal));
}

}  // namespace pdserve::engine::gpu
