#include "engine/fused_projections.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t FusedLayout::padding_rows() const {
  int64_t parts = 0;
  for (int64_t r : part_rows) parts += r;
  return rows - parts;
}

int64_t FusedLayout::scale_rows() const { return CeilDiv(rows, kFusedRowAlign); }

absl::StatusOr<FusedLayout> PlanFusedLayout(const std::vector<int64_t>& part_rows, int64_t cols) {
  if (part_rows.empty()) return absl::InvalidArgumentError("PlanFusedLayout: no parts");
  if (cols < 1) return absl::InvalidArgumentError(absl::StrCat("PlanFusedLayout: cols ", cols));
  FusedLayout layout;
  layout.part_rows = part_rows;
  layout.cols = cols;
  int64_t next = 0;
  for (size_t i = 0; i < part_rows.size(); ++i) {
    if (part_rows[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("PlanFusedLayout: part ", i, " has ", part_rows[i], " rows"));
    }
    layout.row_offset.push_back(next);
    layout.rows = next + part_rows[i];
    next = CeilDiv(layout.rows, kFusedRowAlign) * kFusedRowAlign;
  }
  return layout;
}

std::vector<float> StackBlockScales(const FusedLayout& layout,
                                    const std::vector<const float*>& scales) {
  const int64_t kblocks = CeilDiv(layout.cols, kFusedRowAlign);
  std::vector<float> out(static_cast<size_t>(layout.scale_rows() * kblocks), 0.0f);
  for (size_t i = 0; i < scales.size() && i < layout.part_rows.size(); ++i) {
    const int64_t first = layout.row_offset[i] / kFusedRowAlign;
    const int64_t n = CeilDiv(layout.part_rows[i], kFusedRowAlign) * kblocks;
    std::copy(scales[i], scales[i] + n, out.begin() + first * kblocks);
  }
  return out;
}

FusedGroupSpec AttentionInputGroup(const ModelConfig& c, int64_t layer) {
  const std::string a = absl::StrCat("model.layers.", layer, ".self_attn");
  const LayerType type = c.layer_types[static_cast<size_t>(layer)];
  FusedGroupSpec g;
  g.cols = c.hidden_size;
  auto add = [&](const std::string& name, int64_t rows) {
    g.names.push_back(name);
    g.rows.push_back(rows);
  };
  add(a + ".q_a_proj.weight", c.q_lora_rank);
  add(a + ".kv_proj.weight", c.head_dim);
  if (type == LayerType::kSlidingAttention) return g;
  const bool csa = type == LayerType::kCompressedSparseAttention;
  const std::string comp = a + ".compressor";
  const int64_t width = csa ? 2 * c.head_dim : c.head_dim;  // overlapping windows on CSA
  add(comp + ".kv_proj.weight", width);
  add(comp + ".gate_proj.weight", width);
  if (!csa) return g;
  add(comp + ".indexer.kv_proj.weight", 2 * c.index_head_dim);
  add(comp + ".indexer.gate_proj.weight", 2 * c.index_head_dim);
  add(comp + ".indexer.scorer.weights_proj.weight", c.index_n_heads);
  return g;
}

FusedGroupSpec FfnInputGroup(const ModelConfig& c, int64_t layer) {
  const std::string s = absl::StrCat("model.layers.", layer, ".mlp.shared_experts");
  FusedGroupSpec g;
  g.cols = c.hidden_size;
  g.names = {s + ".gate_proj.weight", s + ".up_proj.weight"};
  g.rows = {c.moe_intermediate_size, c.moe_intermediate_size};
  return g;
}

namespace {

template <typename F>
void ForEachLayout(const ModelConfig& c, F f) {
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (const FusedGroupSpec& g : {AttentionInputGroup(c, l), FfnInputGroup(c, l)}) {
      absl::StatusOr<FusedLayout> layout = PlanFusedLayout(g.rows, g.cols);
      if (layout.ok()) f(*layout);
    }
  }
}

}  // namespace

int64_t FusedOutputWidth(const ModelConfig& c) {
  int64_t width = 0;
  ForEachLayout(c, [&](const FusedLayout& l) { width = std::max(width, l.rows); });
  return width;
}

int64_t FusedPaddingRows(const ModelConfig& c) {
  int64_t rows = 0;
  ForEachLayout(c, [&](const FusedLayout& l) { rows += l.padding_rows(); });
  return rows;
}

}  // namespace pdserve::engine
