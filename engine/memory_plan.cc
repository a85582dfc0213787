#include "engine/memory_plan.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine/checkpoint_layout.h"
#include "engine/expert_parallel.h"
#include "engine/fused_projections.h"
#include "engine/paged_state_plan.h"
#include "engine/ring_state.h"
#include "engine/safetensors.h"
#include "engine/weights.h"
#include "kernels/cuda/moe_gemm_workspace.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool IsExpertName(const std::string& name) {
  return name.find("mlp.experts.") != std::string::npos ||
         name.find("ffn.experts.") != std::string::npos;
}

// The CUDA engine's bytes for a canonical tensor today: matrices bf16, the router's gate fp32
// (routing sees fp32 logits), tid2eid int32, vectors and hyper-connections fp32.
int64_t TodayBytes(const std::string& name, const std::vector<int64_t>& shape) {
  const bool matrix =
      shape.size() >= 2 && name.ends_with(".weight") && !name.ends_with("mlp.gate.weight");
  const bool experts =
      name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj");
  return Elements(shape) * (matrix || experts ? 2 : 4);
}

// The CUDA engine's bytes in `--weights fp8` for a tensor of a quantized checkpoint: experts and
// the FP8 `_proj` matrices fp8_gemm takes (input width a multiple of 128) e4m3 + fp32 scales.
int64_t Fp8ResidentBytes(const std::string& name, const std::vector<int64_t>& shape) {
  const bool fp8 = shape.size() >= 2 && shape.back() % 128 == 0 &&
                   (IsExpertName(name) || name.ends_with("_proj.weight"));
  if (!fp8) return TodayBytes(name, shape);
  const int64_t rows = shape[shape.size() - 2], cols = shape.back();
  const int64_t matrices = Elements(shape) / std::max<int64_t>(1, rows * cols);
  return Elements(shape) + matrices * CeilDiv(rows, 128) * (cols / 128) * 4;
}

std::string Gib(int64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / static_cast<double>(kGiB));
}

// config.json's quantization_config (DeepSeek's releases carry one; bf16 checkpoints do not).
absl::StatusOr<bool> ConfigIsQuantized(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": malformed JSON"));
  return j.contains("quantization_config") && j["quantization_config"].is_object();
}

}  // namespace

const char* StoredFormatName(StoredFormat f) {
  switch (f) {
    case StoredFormat::kFp8Block:
      return "fp8";
    case StoredFormat::kFp4Expert:
      return "fp4";
    case StoredFormat::kBf16:
      return "bf16";
    case StoredFormat::kF32:
      return "f32";
    case StoredFormat::kI32:
      return "i32";
  }
  return "?";
}

StoredFormat StoredFormatOf(const std::string& name, size_t rank, bool integer) {
  if (integer) return StoredFormat::kI32;
  if (IsExpertName(name)) return StoredFormat::kFp4Expert;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight" ||
      name.ends_with("mlp.gate.weight")) {
    return StoredFormat::kBf16;
  }
  return rank == 2 && name.ends_with(".weight") ? StoredFormat::kFp8Block : StoredFormat::kF32;
}

int64_t StoredBytes(StoredFormat format, const std::vector<int64_t>& shape) {
  const int64_t n = Elements(shape);
  if (shape.size() < 2) return n * (format == StoredFormat::kBf16 ? 2 : 4);
  const int64_t rows = shape[shape.size() - 2], cols = shape.back();
  const int64_t matrices = n / std::max<int64_t>(1, rows * cols);
  switch (format) {
    case StoredFormat::kFp8Block:
      return n + matrices * CeilDiv(rows, 128) * CeilDiv(cols, 128);
    case StoredFormat::kFp4Expert:
      return n / 2 + matrices * rows * CeilDiv(cols, 32);
    case StoredFormat::kBf16:
      return 2 * n;
    case StoredFormat::kF32:
    case StoredFormat::kI32:
      return 4 * n;
  }
  return 4 * n;
}

WeightBytes WeightBytesFromConfig(const ModelConfig& config, bool quantized) {
  WeightBytes w;
  w.source = quantized ? "config.json (quantization_config: fp8 128x128 + fp4 experts; no "
                         "checkpoint read)"
                       : "config.json (bf16; no checkpoint read)";
  for (const auto& [name, t] : RequiredTensors(config)) {
    StoredFormat f = StoredFormatOf(name, t.shape.size(), t.integer);
    if (!quantized && f != StoredFormat::kI32) {
      f = t.shape.size() >= 2 ? StoredFormat::kBf16 : StoredFormat::kF32;
    }
    const int64_t bytes = StoredBytes(f, t.shape);
    const bool experts = IsExpertName(name);
    (experts ? w.experts : w.replicated) += bytes;
    (experts ? w.experts_today : w.replicated_today) += TodayBytes(name, t.shape);
    (experts ? w.experts_fp8 : w.replicated_fp8) +=
        quantized ? Fp8ResidentBytes(name, t.shape) : TodayBytes(name, t.shape);
    w.host_fp32 += 4 * Elements(t.shape);
    w.by_dtype[StoredFormatName(f)] += bytes;
  }
  return w;
}

absl::StatusOr<WeightBytes> PlanWeightBytes(const std::string& model_dir,
                                            const ModelConfig& config) {
  if (!HasCheckpointFiles(model_dir)) {
    PDSERVE_ASSIGN_OR_RETURN(const bool quantized, ConfigIsQuantized(model_dir));
    return WeightBytesFromConfig(config, quantized);
  }
  // The engine's own bytes (today) follow from the shapes; the stored ones from the headers.
  WeightBytes w = WeightBytesFromConfig(config, false);
  w.experts = w.replicated = 0;
  w.by_dtype.clear();
  PDSERVE_ASSIGN_OR_RETURN(std::vector<SafetensorsFile> files, OpenCheckpointFiles(model_dir));
  int64_t tensors = 0;
  for (const SafetensorsFile& file : files) {
    for (const TensorInfo& t : file.tensors()) {
      if (IsIgnoredTensorName(t.name)) continue;
      const auto bytes = static_cast<int64_t>(t.end - t.begin);
      (IsExpertName(t.name) ? w.experts : w.replicated) += bytes;
      w.by_dtype[DTypeName(t.dtype)] += bytes;
      ++tensors;
    }
  }
  w.source =
      absl::StrCat("safetensors headers (", tensors, " tensors in ", files.size(), " file(s))");
  if (w.by_dtype.count(DTypeName(DType::kF8E4M3)) > 0) {
    const WeightBytes fp8 = WeightBytesFromConfig(config, /*quantized=*/true);
    w.experts_fp8 = fp8.experts_fp8;
    w.replicated_fp8 = fp8.replicated_fp8;
  }
  return w;
}

SlotStateBytes GpuSlotStateBytes(const ModelConfig& config, int64_t context) {
  SlotStateBytes s;
  const RingGeometry g = RingGeometryFor(config, context, /*page_size=*/64);
  for (const RingLayerGeometry& l : g.layers) {
    s.window += l.window * l.head_dim * 2;
    for (const RingCompressorGeometry* c : {&l.compressor, &l.indexer}) {
      if (!c->present()) continue;
      s.rings += 2 * (2 * c->rate * c->width()) * 4;
      (c == &l.indexer ? s.indexer : s.compressed) += c->entry_capacity * c->dim * 2;
    }
  }
  return s;
}

int64_t HostPoolBytes(const ModelConfig& config, int64_t max_sequences, int64_t token_capacity,
                      int64_t entries_per_page) {
  int64_t csa = 0, hca = 0;
  for (LayerType t : config.layer_types) {
    csa += t == LayerType::kCompressedSparseAttention;
    hca += t == LayerType::kHeavilyCompressedAttention;
  }
  const int64_t layers = config.num_hidden_layers, d = config.head_dim * 4;
  const int64_t i = config.index_head_dim * 4, e = entries_per_page;
  const int64_t m = config.compress_rate_csa, mh = config.compress_rate_hca;
  const int64_t csa_pages = CeilDiv(token_capacity / m, e) + max_sequences;
  const int64_t hca_pages = CeilDiv(token_capacity / mh, e) + max_sequences;
  int64_t bytes = max_sequences * layers * config.sliding_window * d;  // window pages
  bytes += (csa * csa_pages + hca * hca_pages) * e * d;                // compressed entries
  bytes += csa * csa_pages * e * i;                                    // indexer keys
  bytes += max_sequences * csa * 3 * m * 4 * d;                        // CSA open windows
  bytes += max_sequences * hca * mh * 2 * d;                           // HCA open windows
  return bytes;
}

int64_t GpuActivationBytes(const ModelConfig& c, int64_t max_rows, int64_t context, int world) {
  const int64_t r = max_rows, h = c.hidden_size, hc = c.hc_mult;
  const int64_t heads_hd = c.num_attention_heads * c.head_dim, inter = c.moe_intermediate_size;
  const int64_t k = c.num_experts_per_tok, width = 2 * std::max(c.head_dim, c.index_head_dim);
  const int64_t idx_cap = RingEntryCapacity(context, c.compress_rate_csa, 64);
  const int64_t idx = c.index_n_heads * c.index_head_dim;
  int64_t f32 = 0, b16 = 0;                                        // elements per kind of buffer
  f32 += r * (2 * hc * h + (2 + hc) * hc + hc + hc * hc + 2 * h);  // streams .. sub_out
  b16 += r * std::max(h, inter);                                   // x_bf
  f32 += r * (c.q_lora_rank + 2 * heads_hd + c.head_dim);          // q_res, q, attn, kv
  b16 += r * (c.q_lora_rank + 2 * heads_hd + c.head_dim);          // *_bf, new_kv, q_bf
  f32 += r * c.o_groups * c.o_lora_rank;                           // grouped
  b16 += r * c.o_groups * c.o_lora_rank;
  f32 += r * (2 * width + idx + c.index_n_heads + idx_cap + 1 + std::max<int64_t>(1, c.index_topk));
  b16 += r * idx;  // idx_q_bf
  f32 += r * (2 * inter + c.n_routed_experts + 2 * k + c.vocab_size);
  b16 += r * inter;  // act_bf
  // int32 per row: the page table (one page of 64 entries per CSA entry page, the largest
  // capacity), window_len, n_compressed and the row and segment metadata (5 + 4 fields).
  f32 += r * (idx_cap / 64 + 2 + 5 + 4);
  // Fused projections (engine/fused_projections.h): the widest group's output and FP8 o_a's
  // group ids (int32), counted whether or not GpuModelOptions::fused_projections is on (the plan
  // does not see the switch; off, they are an overcount of r * (4160 + 8) values on V4-Flash).
  f32 += r * (FusedOutputWidth(c) + c.o_groups);
  // moe_experts workspace: gate / up / activation rows of every pick (kernels/cuda/moe.cu).
  f32 += world * r * k * 3 * inter;
  if (world > 1) f32 += world * r * (h / 2 + 2 * k + h) + r * h;  // ep_x (bf16), picks, sums
  return 4 * f32 + 2 * b16 + 32 * kMiB;                           // + cuBLAS workspace
}

namespace {

// The largest moe_grouped_gemm workspace of either FP8 expert projection over calls of 1 .. rows
// tokens (AllocateFp8Experts' loop). PlanGpu's searches ask for many row counts up to millions,
// so the running maximum is kept per 1024 rows and shape (thread_local): a query costs at most
// 1023 evaluations past the kept prefix.
size_t Fp8ExpertWorkspace(int64_t rows, int64_t k, int64_t experts, int64_t h, int64_t inter,
                          bool w8a16) {
  namespace mw = kernels::cuda::moe_workspace;
  auto bytes = [&](int64_t t) {
    return std::max(mw::AutoPathBytes(t, k, t, experts, 2 * inter, h, w8a16),
                    mw::AutoPathBytes(t, k, t * k, experts, h, inter, w8a16));
  };
  constexpr int64_t kBlock = 1024;
  // prefix[b]: the largest over 1 .. b * kBlock tokens.
  thread_local std::map<std::array<int64_t, 5>, std::vector<size_t>> cache;
  std::vector<size_t>& prefix = cache[{k, experts, h, inter, w8a16 ? 1 : 0}];
  if (prefix.empty()) prefix.push_back(0);
  const int64_t blocks = rows / kBlock;
  while (static_cast<int64_t>(prefix.size()) <= blocks) {
    const auto b = static_cast<int64_t>(prefix.size());
    size_t most = prefix.back();
    for (int64_t t = (b - 1) * kBlock + 1; t <= b * kBlock; ++t) most = std::max(most, bytes(t));
    prefix.push_back(most);
  }
  size_t most = prefix[static_cast<size_t>(blocks)];
  for (int64_t t = blocks * kBlock + 1; t <= rows; ++t) most = std::max(most, bytes(t));
  return most;
}

}  // namespace

Fp8ExpertBytes GpuFp8ExpertBytes(const ModelConfig& c, int64_t max_rows, int world, bool w8a16) {
  const int64_t rows = std::max(1, world) * max_rows, k = c.num_experts_per_tok;
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
  Fp8ExpertBytes b;
  b.outputs = 2 * rows * k * (2 * inter + inter + h);  // moe_gate_up, moe_act, moe_down (bf16)
  const size_t workspace =
      Fp8ExpertWorkspace(rows, k, CeilDiv(c.n_routed_experts, std::max(1, world)), h, inter, w8a16);
  b.workspace = static_cast<int64_t>(std::max<size_t>(workspace, 256));
  return b;
}

int64_t DecodeBuckets(int64_t slots) {
  int64_t n = 1;  // slots itself
  for (int64_t b = 1; b < slots; b *= 2) ++n;
  return n;
}

namespace {

// Largest x in [0, hi] with fits(x) (fits is monotone: true up to some x, then false).
template <typename Fits>
int64_t LargestFitting(int64_t hi, Fits fits) {
  int64_t lo = 0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace

GpuPlan PlanGpu(const ModelConfig& config, int64_t expert_bytes, int64_t replicated_bytes,
                const PlanRequest& q) {
  const int64_t world = std::max(1, q.world);
  const int64_t per_expert = expert_bytes / std::max<int64_t>(1, config.n_routed_experts);
  const int64_t weights = replicated_bytes + per_expert * CeilDiv(config.n_routed_experts, world);
  // One rank's plan at `slots` slots (plus the scratch slot) of `context` tokens.
  auto plan = [&](int64_t slots, int64_t context) {
    GpuPlan p;
    p.weights = weights;
    p.slots = slots;
    p.activations =
        GpuActivationBytes(config, std::max(q.max_chunk, slots), context, static_cast<int>(world));
    p.state = !q.prefill && q.state_tokens > 0
                  ? GpuStatePoolBytes(config, slots, context, CeilDiv(q.state_tokens, world),
                                      /*paged=*/true)
                  : (slots + 1) * GpuSlotStateBytes(config, context).total();
    p.graphs = q.prefill ? 0 : DecodeBuckets(slots) * kGraphAllowance;
    p.runtime = kRuntimeAllowance;
    p.transfer = q.cuda_ipc_arena_bytes + q.cuda_ipc_pool_bytes;
    if (q.fp8_experts) {
      p.fp8_experts = GpuFp8ExpertBytes(config, std::max(q.max_chunk, slots),
                                        static_cast<int>(world), !q.fp8_activations)
                          .total();
    }
    WorkspaceRequest wq;
    wq.max_rows = std::max(q.max_chunk, slots);
    wq.slots = slots;
    wq.context = context;
    // The checkpoint's FP8 matrices stay FP8 exactly where its experts do (WithFp8Experts).
    wq.fp8_projections = q.fp8_experts;
    wq.w8a8 = q.fp8_activations;
    wq.shared_act_quant = q.fp8_shared_act_quant;
    wq.sampler = !q.prefill;
    p.workspace = GpuWorkspaceBytes(config, wq);
    return p;
  };
  GpuPlan p = plan(q.prefill ? 1 : CeilDiv(q.max_batch, world), q.max_context);
  auto fits = [&](int64_t slots, int64_t context) {
    return slots >= 1 && plan(slots, context).total() <= q.gpu_bytes;
  };
  // Batch: slots per rank (prefill: one), activations and graphs growing with them.
  const int64_t max_slots = q.prefill ? 1 : int64_t{1} << 20;
  p.max_batch_at_context =
      world * LargestFitting(max_slots, [&](int64_t s) { return fits(s, q.max_context); });
  p.max_context_at_batch =
      LargestFitting(config.max_position_embeddings, [&](int64_t c) { return fits(p.slots, c); });
  return p;
}

namespace {

// The bytes the CUDA engine holds for the request's weight format.
int64_t EngineExperts(const WeightBytes& w, const PlanRequest& q) {
  return q.fp8_weights ? w.experts_fp8 : w.experts_today;
}
int64_t EngineReplicated(const WeightBytes& w, const PlanRequest& q) {
  return q.fp8_weights ? w.replicated_fp8 : w.replicated_today;
}

std::string PlanRow(const char* what, int64_t stored, int64_t today) {
  return absl::StrFormat("  %-34s %14s %14s\n", what, Gib(stored), Gib(today));
}

std::string CountRow(const char* what, int64_t stored, int64_t today) {
  return absl::StrFormat("  %-34s %14d %14d\n", what, stored, today);
}

// `request` with fp8_experts from the weights: FP8 resident experts where `weights: fp8` meets a
// quantized checkpoint (WeightBytes::experts_fp8 differs from the bf16 bytes).
PlanRequest WithFp8Experts(const WeightBytes& w, PlanRequest request) {
  request.fp8_experts = request.fp8_weights && w.experts_fp8 != w.experts_today;
  return request;
}

// The plan's line for transfer.cuda_ipc's device memory.

std::string CudaIpcRowName(const PlanRequest& q) {
  if (q.cuda_ipc_arena_bytes + q.cuda_ipc_pool_bytes == 0) return "CUDA IPC (none)";
  return q.prefill ? absl::StrCat("CUDA IPC arena (", q.cuda_ipc_tokens, " tok)")
                   : absl::StrCat("CUDA IPC pool (", q.cuda_ipc_tokens, " tok/request)");
}

// The plan's workspace lines (GpuWorkspaceBytes), each where either column has bytes.
std::string WorkspaceRows(const WorkspaceBytes& s, const WorkspaceBytes& t) {
  std::string out;
  const auto row = [&](const char* what, int64_t WorkspaceBytes::*part) {
    if (s.*part + t.*part > 0) absl::StrAppend(&out, PlanRow(what, s.*part, t.*part));
  };
  row("workspace: dense FP8 GEMMs", &WorkspaceBytes::dense_fp8);
  row("workspace: W8A8 shared act quant", &WorkspaceBytes::act_quant);
  row("workspace: grouped o_a", &WorkspaceBytes::o_a_grouped);
  row("workspace: decode attention", &WorkspaceBytes::attention);
  row("workspace: GPU sampler", &WorkspaceBytes::sampler);
  return out;
}

}  // namespace

namespace {

// The paged state's lines of FormatPlan for a decode worker whose engine plan is `t`.
std::string PagedCapacity(const ModelConfig& config, const PlanRequest& q, const GpuPlan& t) {
  const int64_t world = std::max(1, q.world);
  const int64_t state_tokens = CeilDiv(q.state_tokens, world);
  std::string out = absl::StrCat("  paged state, state_tokens ", q.state_tokens,
                                 q.state_tokens == 0 ? " (every slot full)" : "",
                                 ": requests admitted at once (per group):");
  for (int64_t tokens : {int64_t{8192}, int64_t{32768}, int64_t{131072}}) {
    absl::StrAppend(
        &out, " ", tokens / 1024,
        "K: ", world * AdmittedRequests(config, t.slots, q.max_context, state_tokens, tokens), ";");
  }
  const int64_t budget = q.gpu_bytes - t.weights - t.activations - t.graphs - t.runtime -
                         t.transfer - t.fp8_experts - t.workspace.total();
  absl::StrAppend(&out, "\n  state budget ", Gib(std::max<int64_t>(budget, 0)),
                  " per GPU fits (paged / slot layout, per group):");
  for (int64_t tokens : {int64_t{8192}, int64_t{32768}, int64_t{131072}}) {
    if (tokens > q.max_context || budget <= 0) {
      absl::StrAppend(&out, " ", tokens / 1024, "K: 0 / 0;");
      continue;
    }
    absl::StrAppend(
        &out, " ", tokens / 1024,
        "K: ", world * ConcurrentRequestsThatFit(config, tokens, q.max_context, budget, true),
        " / ", world * ConcurrentRequestsThatFit(config, tokens, q.max_context, budget, false),
        ";");
  }
  absl::StrAppend(&out, "\n");
  return out;
}

}  // namespace

std::string FormatPlan(const ModelConfig& config, const WeightBytes& w,
                       const PlanRequest& request) {
  const PlanRequest q = WithFp8Experts(w, request);
  const GpuPlan s = PlanGpu(config, w.experts, w.replicated, q);
  const GpuPlan t = PlanGpu(config, EngineExperts(w, q), EngineReplicated(w, q), q);
  std::string out = absl::StrFormat(
      "%s: %s, %d GPU(s) of %s, %d layers, context %d tokens, %s\n", q.worker,
      q.prefill ? absl::StrCat("prefill (one sequence per rank, forward calls of up to ",
                               q.max_chunk, " tokens)")
                : absl::StrCat("decode batch ", q.max_batch),
      q.world, Gib(q.gpu_bytes), config.num_hidden_layers, q.max_context,
      q.world > 1 ? "one expert-parallel group: every GPU holds every layer and a replica of all "
                    "but the routed experts, which are split over the GPUs"
                  : "one GPU holds the whole model");
  absl::StrAppend(&out, "  weights from ", w.source, ": routed experts ", Gib(w.experts),
                  ", the rest ", Gib(w.replicated), " (");
  for (const auto& [dtype, bytes] : w.by_dtype) absl::StrAppend(&out, dtype, " ", Gib(bytes), " ");
  absl::StrAppend(&out, ")\n");
  absl::StrAppendFormat(&out, "  %-34s %14s %14s\n", "per GPU", "stored dtypes",
                        q.fp8_weights ? "engine (fp8)" : "today (bf16)");
  absl::StrAppend(&out, PlanRow("weights", s.weights, t.weights));
  absl::StrAppend(&out, PlanRow(absl::StrCat("state (", s.slots, " slots + scratch)").c_str(),
                                s.state, t.state));
  absl::StrAppend(&out, PlanRow("activations + cuBLAS workspace", s.activations, t.activations));
  absl::StrAppend(&out, PlanRow("CUDA graphs (allowance)", s.graphs, t.graphs));
  absl::StrAppend(&out, PlanRow("context/NCCL (allowance)", s.runtime, t.runtime));
  absl::StrAppend(&out, PlanRow(CudaIpcRowName(q).c_str(), s.transfer, t.transfer));
  if (q.fp8_experts) {
    absl::StrAppend(&out,
                    PlanRow("FP8 experts: outputs + workspace", s.fp8_experts, t.fp8_experts));
  }
  absl::StrAppend(&out, WorkspaceRows(s.workspace, t.workspace));
  absl::StrAppend(&out, PlanRow("total", s.total(), t.total()));
  absl::StrAppendFormat(&out, "  %-34s %14s %14s\n", "fits",
                        s.total() <= q.gpu_bytes ? "yes" : "NO",
                        t.total() <= q.gpu_bytes ? "yes" : "NO");
  absl::StrAppend(&out, CountRow(absl::StrCat("largest batch at ", q.max_context).c_str(),
                                 s.max_batch_at_context, t.max_batch_at_context));
  absl::StrAppend(&out, CountRow("largest context at this batch", s.max_context_at_batch,
                                 t.max_context_at_batch));
  const SlotStateBytes slot = GpuSlotStateBytes(config, q.max_context);
  absl::StrAppendFormat(&out,
                        "  one slot at %d tokens: window %s, compressor rings %s, compressed "
                        "entries %s, indexer keys %s\n",
                        q.max_context, Gib(slot.window), Gib(slot.rings), Gib(slot.compressed),
                        Gib(slot.indexer));
  const int64_t seqs = q.prefill ? 1 : q.max_batch;
  absl::StrAppend(&out, "  host: state page pool (fp32) ",
                  Gib(HostPoolBytes(config, seqs, seqs * q.max_context)),
                  q.fp8_weights
                      ? "; the fp8 loader copies each tensor from the mmapped shards in its stored "
                        "dtype (no fp32 copy)\n"
                      : absl::StrCat("; the bf16 loader also builds an fp32 copy of every weight: ",
                                     Gib(w.host_fp32), "\n"));
  absl::StrAppend(&out, "  largest batch (stored / today) at context:");
  for (int64_t ctx : {int64_t{4096}, int64_t{32768}, int64_t{131072}, int64_t{1048576}}) {
    if (ctx > config.max_position_embeddings) break;
    PlanRequest at = q;
    at.max_context = ctx;
    absl::StrAppend(
        &out, " ", ctx, ": ", PlanGpu(config, w.experts, w.replicated, at).max_batch_at_context,
        " / ",
        PlanGpu(config, EngineExperts(w, q), EngineReplicated(w, q), at).max_batch_at_context, ";");
  }
  absl::StrAppend(&out, "\n");
  if (!q.prefill) absl::StrAppend(&out, PagedCapacity(config, q, t));
  return out;
}

absl::Status CheckPlanFits(const ModelConfig& config, const WeightBytes& w,
                           const PlanRequest& request) {
  const PlanRequest q = WithFp8Experts(w, request);
  const GpuPlan t = PlanGpu(config, EngineExperts(w, q), EngineReplicated(w, q), q);
  if (t.total() <= q.gpu_bytes) return absl::OkStatus();
  std::string msg = absl::StrCat(
      q.worker, ": does not fit: ", Gib(t.total()), " per GPU needed (weights ", Gib(t.weights),
      q.fp8_weights ? " as the CUDA engine holds them in --weights fp8"
                    : " as today's CUDA engine holds them, bf16",
      "; state ", Gib(t.state), " for ", t.slots, " slot(s) + scratch at ", q.max_context,
      " tokens; activations ", Gib(t.activations), "; workspaces ", Gib(t.workspace.total()),
      t.fp8_experts > 0 ? absl::StrCat("; FP8 experts' outputs and workspace ", Gib(t.fp8_experts))
                        : "",
      t.transfer > 0
          ? absl::StrCat("; CUDA IPC ", q.prefill ? "arena " : "device page pool ", Gib(t.transfer))
          : "",
      "), ", Gib(q.gpu_bytes), " per GPU available. Change one of: ");
  std::vector<std::string> changes;
  const int64_t rest = q.gpu_bytes - t.activations - t.graphs - t.runtime - t.transfer -
                       t.fp8_experts - t.workspace.total() -
                       (t.slots + 1) * GpuSlotStateBytes(config, q.max_context).total();
  if (t.weights >= q.gpu_bytes - t.runtime || rest < t.weights) {
    changes.push_back(
        "more GPUs in the worker's `gpus` (the routed experts are split over them), or a model "
        "with fewer layers (every GPU holds every layer: the engine has no pipeline "
        "parallelism)");
  }
  if (t.max_context_at_batch > 0) {
    changes.push_back(absl::StrCat(
        "a shorter context (", t.max_context_at_batch, " tokens fit at this batch: ",
        q.prefill ? "`pdserve plan --max-context`"
                  : "--pool-tokens of pdserve decode or serve, `pdserve plan --max-context`",
        ")"));
  }
  if (t.max_batch_at_context > 0 && !q.prefill) {
    changes.push_back(absl::StrCat("a smaller --max-batch (", t.max_batch_at_context, " fit at ",
                                   q.max_context, " tokens)"));
  }
  // First, and only, when the rest fits without it ("change one of": a 0.00 GiB arena was named
  // for a worker 400 GiB short).
  if (t.transfer > 0 && t.total() - t.transfer <= q.gpu_bytes) {
    changes.insert(
        changes.begin(),
        absl::StrCat("a lower transfer.cuda_ipc_arena_tokens (", q.cuda_ipc_tokens,
                     " tokens a request now: the ", q.prefill ? "arena" : "device page pool",
                     " takes ", Gib(t.transfer), ") or transfer.cuda_ipc: off"));
  }
  absl::StrAppend(&msg, absl::StrJoin(changes, "; "));
  return absl::ResourceExhaustedError(msg);
}

absl::StatusOr<int64_t> AutoStateTokens(const ModelConfig& config, const WeightBytes& w,
                                        const PlanRequest& request) {
  const PlanRequest q = WithFp8Experts(w, request);
  if (q.prefill) {
    return absl::InvalidArgumentError("state_tokens auto: a prefill worker keeps no paged state");
  }
  const int64_t world = std::max(1, q.world);
  const int64_t full = CeilDiv(q.max_batch, world) * q.max_context;  // per rank
  const int64_t budget = q.gpu_bytes - static_cast<int64_t>(kAutoStateMargin * q.gpu_bytes);
  auto plan = [&](int64_t per_rank) {
    PlanRequest at = q;
    at.state_tokens = per_rank * world;
    return PlanGpu(config, EngineExperts(w, q), EngineReplicated(w, q), at);
  };
  auto fits = [&](int64_t per_rank) { return plan(per_rank).total() <= budget; };
  if (full < 1 || !fits(1)) {
    const GpuPlan p = plan(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        q.worker, ": state_tokens auto: no room for paged state: weights ", Gib(p.weights),
        ", activations ", Gib(p.activations), ", graphs and runtime ", Gib(p.graphs + p.runtime),
        ", the fixed state of ", p.slots, " slot(s) + scratch and one token of pages ",
        Gib(p.state), " need ", Gib(p.total()), " per GPU, more than ", Gib(budget), " (",
        Gib(q.gpu_bytes), " less the ", static_cast<int>(kAutoStateMargin * 100),
        "% margin); lower max_batch or max_context, or add GPUs"));
  }
  return world * LargestFitting(full, fits);
}

}  // namespace pdserve::engine
