#include "engine/gpu_workspace_plan.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "absl/status/statusor.h"
#include "engine/checkpoint_layout.h"
#include "engine/fused_projections.h"
#include "engine/ring_state.h"
#include "kernels/cuda/fp8_gemm_workspace.h"
#include "kernels/cuda/moe_gemm_workspace.h"
#include "kernels/cuda/sampling_workspace.h"
#include "kernels/cuda/sparse_decode_workspace.h"
#include "kernels/env_switch.h"

namespace pdserve::engine {
namespace {

constexpr int64_t kActQuantBlock = 128;  // kernels/cuda/act_quant.cuh kActQuantBlock

int64_t AlignUp256(int64_t bytes) { return (bytes + 255) & ~int64_t{255}; }

bool IsExpertName(const std::string& name) {
  return name.find("mlp.experts.") != std::string::npos ||
         name.find("ffn.experts.") != std::string::npos;
}

}  // namespace

int64_t ActQuantGroupBytes(int64_t rows, int64_t k, int64_t group_cols) {
  return k / group_cols * AlignUp256(rows * group_cols);
}

int64_t ActQuantGroupScales(int64_t rows, int64_t k, int64_t group_cols) {
  return k / group_cols * (AlignUp256(rows * (group_cols / kActQuantBlock) * 4) / 4);
}

bool SharedActQuantOption(bool option) {
  return kernels::ReadSwitchOverride("PDSERVE_FP8_SHARED_ACT_QUANT",
                                     "the option (GpuModelOptions::fp8_shared_act_quant)")
      .value_or(option);
}

SharedActQuantBytes SharedActQuantBuffers(const ModelConfig& c, int64_t max_rows) {
  const int64_t r = max_rows;
  const int64_t heads_hd = c.num_attention_heads * c.head_dim;
  const int64_t group_in = heads_hd / std::max<int64_t>(c.o_groups, 1);
  const bool groups = group_in % kActQuantBlock == 0;
  SharedActQuantBytes b;
  b.rows0 = std::max(r * c.hidden_size, r * c.o_groups * c.o_lora_rank);
  b.scales0 = b.rows0 / kActQuantBlock;
  b.rows1 = std::max({r * c.q_lora_rank, r * c.moe_intermediate_size,
                      groups ? ActQuantGroupBytes(r, heads_hd, group_in) : int64_t{0}});
  b.scales1 = std::max(b.rows1 / kActQuantBlock,
                       groups ? ActQuantGroupScales(r, heads_hd, group_in) : int64_t{0});
  return b;
}

std::vector<std::pair<int64_t, int64_t>> DenseFp8Projections(const ModelConfig& c, bool fused) {
  std::set<std::string> stacked;  // parts of a fused group: their group's shape instead
  std::set<std::pair<int64_t, int64_t>> shapes;
  if (fused) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (const FusedGroupSpec& g : {AttentionInputGroup(c, l), FfnInputGroup(c, l)}) {
        if (g.cols % kActQuantBlock != 0) continue;  // not FP8: stays unfused bf16
        const absl::StatusOr<FusedLayout> layout = PlanFusedLayout(g.rows, g.cols);
        if (!layout.ok()) continue;
        stacked.insert(g.names.begin(), g.names.end());
        shapes.insert({layout->rows, layout->cols});
      }
    }
  }
  for (const auto& [name, t] : RequiredTensors(c)) {
    if (t.shape.size() != 2 || t.integer || IsExpertName(name) || !name.ends_with("_proj.weight") ||
        t.shape[1] % kActQuantBlock != 0 || stacked.count(name) > 0) {
      continue;
    }
    // o_a runs per group: [rows / groups, in] blocks of its rows.
    const int64_t n = name.ends_with("o_a_proj.weight")
                          ? t.shape[0] / std::max<int64_t>(1, c.o_groups)
                          : t.shape[0];
    shapes.insert({n, t.shape[1]});
  }
  return {shapes.begin(), shapes.end()};
}

namespace {

// fp8_workspace::ProjectionBytes at the default PDSERVE_FP8_GEMM and wgmma config, with the
// largest over 1 .. m rows kept up to MonotoneRows per shape (thread_local): PlanGpu's searches ask
// for many row counts.
size_t ProjectionBytesCached(int64_t max_rows, int64_t n, int64_t k, bool shared) {
  namespace fw = kernels::cuda::fp8_workspace;
  const kernels::cuda::Fp8WgmmaConfig& config = kernels::cuda::kFp8WgmmaDecodeConfig;
  const int64_t monotone = fw::MonotoneRows(config);
  thread_local std::map<std::tuple<int64_t, int64_t, bool>, std::vector<size_t>> cache;
  std::vector<size_t>& prefix = cache[{n, k, shared}];  // prefix[m]: the largest over 1 .. m
  const int64_t upto = std::min(max_rows, monotone);
  if (prefix.empty()) prefix.push_back(0);
  while (static_cast<int64_t>(prefix.size()) <= upto) {
    const auto m = static_cast<int64_t>(prefix.size());
    prefix.push_back(std::max(prefix.back(), fw::RowBytes(m, n, k, shared, "", config)));
  }
  size_t most = prefix[static_cast<size_t>(upto)];
  for (int64_t m = std::max(monotone + 1, max_rows - 3); m <= max_rows; ++m) {
    most = std::max(most, fw::RowBytes(m, n, k, shared, "", config));
  }
  return most;
}

}  // namespace

int64_t DenseFp8WorkspaceBytes(const ModelConfig& c, int64_t max_rows, bool shared_act_quant) {
  size_t most = 0;
  for (bool fused : {false, true}) {
    for (const auto& [n, k] : DenseFp8Projections(c, fused)) {
      most = std::max(most, ProjectionBytesCached(max_rows, n, k, shared_act_quant));
    }
  }
  return static_cast<int64_t>(std::max<size_t>(most, 256));  // AllocateFp8's floor
}

int64_t OaGroupedWorkspaceBytes(const ModelConfig& c, int64_t max_rows, bool w8a16) {
  if (c.o_groups > 32 || c.o_groups < 1) return 0;  // AllocateFused: per-group calls only
  const int64_t group_in = c.num_attention_heads * c.head_dim / c.o_groups;
  size_t bytes = 0;
  for (int64_t t = 1; t <= std::min(max_rows, kOaGroupedMaxRows); ++t) {
    bytes = std::max(
        bytes, kernels::cuda::moe_workspace::AutoPathBytes(
                   t, c.o_groups, t * c.o_groups, c.o_groups, c.o_lora_rank, group_in, w8a16));
  }
  return static_cast<int64_t>(std::max<size_t>(bytes, 256));
}

int64_t DecodeAttentionWorkspaceBytes(const ModelConfig& c, int64_t slots, int64_t context) {
  namespace sd = kernels::cuda::sparse_decode_workspace;
  // GpuModel::Create's fast_attention: the fixed-shape kernel's head_dim and head groups.
  if (c.head_dim != kernels::cuda::kSparseHeadDim ||
      c.num_attention_heads % kernels::cuda::kSparseHeadsPerBlock != 0) {
    return 0;
  }
  std::vector<int64_t> entries;  // per layer: window + compressed slots (DecodeParams)
  for (LayerType t : c.layer_types) {
    const bool csa = t == LayerType::kCompressedSparseAttention;
    const bool hca = t == LayerType::kHeavilyCompressedAttention;
    const int64_t compressed = csa   ? c.index_topk
                               : hca ? RingEntryCapacity(context, c.compress_rate_hca, 64)
                                     : 0;
    entries.push_back(c.sliding_window + compressed);
  }
  std::vector<int64_t> buckets;  // GpuModel::Create's default decode buckets
  for (int64_t b = 1; b < slots; b *= 2) buckets.push_back(b);
  buckets.push_back(slots);
  size_t bytes = 1;
  for (int64_t batch : buckets) {
    for (int64_t e : entries) {
      bytes = std::max(bytes, sd::DecodeCallBytes(batch, c.num_attention_heads, e, kPlanSmCount));
    }
  }
  return static_cast<int64_t>(bytes);
}

int64_t SamplerBytes(const ModelConfig& c, int64_t slots) {
  namespace sw = kernels::cuda::sampling_workspace;
  const size_t workspace = sw::Bytes(slots, c.vocab_size);
  if (workspace == 0) return 0;  // GpuSampler::Create refuses (PDSERVE_HOST_SAMPLER)
  return static_cast<int64_t>(workspace + static_cast<size_t>(slots) * sw::kSampledRowBytes);
}

WorkspaceBytes GpuWorkspaceBytes(const ModelConfig& c, const WorkspaceRequest& q) {
  WorkspaceBytes w;
  if (q.fp8_projections) {
    const bool shared = q.w8a8 && q.shared_act_quant;
    w.dense_fp8 = DenseFp8WorkspaceBytes(c, q.max_rows, shared);
    if (shared) w.act_quant = SharedActQuantBuffers(c, q.max_rows).bytes();
    w.o_a_grouped = OaGroupedWorkspaceBytes(c, q.max_rows, !q.w8a8);
  }
  w.attention = DecodeAttentionWorkspaceBytes(c, q.slots, q.context);
  if (q.sampler) w.sampler = SamplerBytes(c, q.slots);
  return w;
}

}  // namespace pdserve::engine
