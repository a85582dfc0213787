// engine/memory_plan.h against what the engine allocates: the host state pool's bytes for the
// bundled model (PagePool as the workers create it), one CUDA slot's bytes against the ring
// layout's sizes (engine/ring_state.h, what GpuModel allocates per slot), the weight bytes read
// from a checkpoint's headers against the files' data sections, and the refusal of a config
// that cannot fit.
#include "engine/memory_plan.h"

#include <cstdio>
#include <filesystem>
#include <string>

#include "engine/config.h"
#include "engine/paged_state_plan.h"
#include "engine/ring_state.h"
#include "engine/safetensors.h"
#include "gtest/gtest.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"

namespace pdserve::engine {
namespace {

int64_t PoolBytes(const serving::PagePool& pool) {
  int64_t bytes = 0;
  for (int32_t k = 0; k < pool.num_kinds(); ++k) {
    bytes += pool.kind(k).page_bytes() * pool.pages_total(k);
  }
  return bytes;
}

TEST(MemoryPlanTest, HostPoolBytesEqualWhatThePagePoolAllocates) {
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(config.ok()) << config.status();
  auto layout = runtime::LayoutForModel(*config);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (auto [seqs, tokens] : {std::pair<int64_t, int64_t>{1, 512}, {64, 64 * 512}, {3, 700}}) {
    auto pool = serving::PagePool::Create(layout->PoolOptions(seqs, tokens));
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ(HostPoolBytes(*config, seqs, tokens), PoolBytes(**pool)) << seqs << " x " << tokens;
  }
}

TEST(MemoryPlanTest, SlotBytesEqualTheRingLayoutsSizes) {
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(config.ok()) << config.status();
  for (int64_t context : {1, 64, 333, 512}) {
    const RingImage image = NewRingImage(RingGeometryFor(*config, context, 64));
    int64_t bf16 = 0, f32 = 0;  // the device stores windows and entries bf16, rings fp32
    for (const RingLayerImage& l : image.layers) {
      bf16 += static_cast<int64_t>(l.window.size() + l.compressor.entries.size() +
                                   l.indexer.entries.size());
      f32 += static_cast<int64_t>(l.compressor.ring_kv.size() + l.compressor.ring_gate.size() +
                                  l.indexer.ring_kv.size() + l.indexer.ring_gate.size());
    }
    const SlotStateBytes s = GpuSlotStateBytes(*config, context);
    EXPECT_EQ(s.total(), 2 * bf16 + 4 * f32) << context;
    EXPECT_GT(s.compressed, 0);
    EXPECT_GT(s.indexer, 0);
  }
}

TEST(MemoryPlanTest, CheckpointHeadersGiveTheDataSectionBytes) {
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(config.ok()) << config.status();
  auto w = PlanWeightBytes(PDSERVE_BUNDLED_MODEL, *config);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string file = std::string(PDSERVE_BUNDLED_MODEL) + "/model.safetensors";
  auto st = SafetensorsFile::Open(file);
  ASSERT_TRUE(st.ok()) << st.status();
  int64_t data = 0;
  for (const TensorInfo& t : st->tensors()) data += static_cast<int64_t>(t.end - t.begin);
  EXPECT_EQ(w->experts + w->replicated, data);
  EXPECT_GT(w->experts, 0);
  EXPECT_NE(w->source.find("safetensors headers"), std::string::npos);
}

std::string FlashDir() {
  return std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/v4_configs/flash";
}

TEST(MemoryPlanTest, AFlashConfigOnOneGpuIsRefusedNamingWhatToChange) {
  const std::string dir = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/v4_configs/flash";
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto w = PlanWeightBytes(dir, *config);
  ASSERT_TRUE(w.ok()) << w.status();
  PlanRequest q;
  q.worker = "decode-0";
  q.max_batch = 64;
  q.max_context = 65536;
  const absl::Status s = CheckPlanFits(*config, *w, q);
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("decode-0: does not fit"), std::string::npos) << s;
  EXPECT_NE(s.message().find("more GPUs"), std::string::npos) << s;
  q.world = 8;  // 8 H200s hold V4-Flash in bf16 at a smaller batch x context
  q.max_batch = 8;
  q.max_context = 4096;
  EXPECT_TRUE(CheckPlanFits(*config, *w, q).ok()) << FormatPlan(*config, *w, q);
}

// `weights: fp8` (FP8 experts and projections on the GPU, engine/gpu/gpu_model.h): V4-Flash's
// 43 layers on 4 H200s at batch 8 x 4096 fit, where the bf16 engine's bytes do not; the FP8
// experts are the FP4 release's expert bytes doubled, less the ue8m0 group scales, plus fp32
// block scales.
TEST(MemoryPlanTest, Fp8WeightsFitAFlashWorkerThatBf16DoesNot) {
  const std::string dir = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/v4_configs/flash";
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto w = PlanWeightBytes(dir, *config);
  ASSERT_TRUE(w.ok()) << w.status();
  const int64_t e = config->n_routed_experts, h = config->hidden_size;
  const int64_t inter = config->moe_intermediate_size, layers = config->num_hidden_layers;
  EXPECT_EQ(w->experts_fp8, layers * e *
                                (3 * h * inter + (2 * inter / 128) * (h / 128) * 4 +
                                 (h / 128) * (inter / 128) * 4));
  EXPECT_EQ(w->experts_today, 2 * layers * e * 3 * h * inter);
  EXPECT_LT(w->replicated_fp8, w->replicated_today);
  PlanRequest q;
  q.worker = "decode-0";
  q.world = 4;
  q.max_batch = 8;
  q.max_context = 4096;
  const absl::Status bf16 = CheckPlanFits(*config, *w, q);
  EXPECT_EQ(bf16.code(), absl::StatusCode::kResourceExhausted) << bf16;
  q.fp8_weights = true;
  EXPECT_TRUE(CheckPlanFits(*config, *w, q).ok()) << FormatPlan(*config, *w, q);
  EXPECT_NE(FormatPlan(*config, *w, q).find("engine (fp8)"), std::string::npos);
}

// A decode worker's plan with paged state (PlanRequest::state_tokens): the state is the pools'
// bytes, smaller than every slot full, and the text gives the requests admitted at once.
TEST(MemoryPlanTest, StateTokensShrinkTheStateAndThePlanPrintsTheCapacity) {
  auto config = ModelConfig::Load(FlashDir());
  ASSERT_TRUE(config.ok()) << config.status();
  auto w = PlanWeightBytes(FlashDir(), *config);
  ASSERT_TRUE(w.ok()) << w.status();
  PlanRequest q{.worker = "decode-0", .world = 4, .fp8_weights = true};
  q.max_batch = 64;
  q.max_context = 131072;
  const GpuPlan full = PlanGpu(*config, w->experts_fp8, w->replicated_fp8, q);
  q.state_tokens = 64 * 8192;
  const GpuPlan paged = PlanGpu(*config, w->experts_fp8, w->replicated_fp8, q);
  EXPECT_EQ(paged.state, GpuStatePoolBytes(*config, 16, 131072, 16 * 8192, true));
  EXPECT_LT(paged.state, full.state);
  const int64_t admitted_8k = 4 * AdmittedRequests(*config, 16, 131072, 16 * 8192, 8192);
  EXPECT_EQ(admitted_8k, 64);  // every slot: the pools were sized for 64 requests of 8K
  const std::string text = FormatPlan(*config, *w, q);
  EXPECT_NE(text.find("paged state, state_tokens 524288: requests admitted at once (per group): "
                      "8K: 64; 32K: " +
                      std::to_string(4 * AdmittedRequests(*config, 16, 131072, 16 * 8192, 32768))),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("state budget"), std::string::npos) << text;
}

// `state_tokens: auto`: the largest state_tokens (a multiple of the GPUs) whose plan fits the GPU
// less the margin; one more token a GPU does not; every slot full is the cap; a GPU the fixed
// part already fills is refused.
TEST(MemoryPlanTest, AutoStateTokensFillTheGpuLessTheMargin) {
  auto config = ModelConfig::Load(FlashDir());
  ASSERT_TRUE(config.ok()) << config.status();
  auto w = PlanWeightBytes(FlashDir(), *config);
  ASSERT_TRUE(w.ok()) << w.status();
  PlanRequest q{.worker = "decode-0", .world = 4, .fp8_weights = true};
  q.max_context = 131072;
  // 64 slots of 128K fit 4 H200s: every slot full is the cap.
  q.max_batch = 64;
  EXPECT_EQ(*AutoStateTokens(*config, *w, q), 64 * 131072);
  // 1024 slots do not: the pools get what is left.
  q.max_batch = 1024;
  const absl::StatusOr<int64_t> t = AutoStateTokens(*config, *w, q);
  ASSERT_TRUE(t.ok()) << t.status();
  const int64_t budget = q.gpu_bytes - static_cast<int64_t>(kAutoStateMargin * q.gpu_bytes);
  auto total = [&](int64_t state_tokens) {
    PlanRequest at = q;
    at.state_tokens = state_tokens;
    at.fp8_experts = true;  // as AutoStateTokens sets it: the fixture's experts are quantized
    return PlanGpu(*config, w->experts_fp8, w->replicated_fp8, at).total();
  };
  EXPECT_EQ(*t % 4, 0);
  EXPECT_LE(total(*t), budget);
  EXPECT_GT(total(*t + 4), budget);
  EXPECT_LT(*t, 1024 * 131072);
  EXPECT_FALSE(CheckPlanFits(*config, *w, q).ok());  // the default, every slot full
  PlanRequest sized = q;
  sized.state_tokens = *t;
  EXPECT_TRUE(CheckPlanFits(*config, *w, sized).ok()) << FormatPlan(*config, *w, sized);
  // One where the weights alone leave nothing.
  q.gpu_bytes = 8 * kGiB;
  const absl::StatusOr<int64_t> none = AutoStateTokens(*config, *w, q);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("decode-0: state_tokens auto: no room for paged state"),
            std::string_view::npos)
      << none.status();
  q.prefill = true;
  EXPECT_EQ(AutoStateTokens(*config, *w, q).status().code(), absl::StatusCode::kInvalidArgument);
}

// The FP8 experts' device buffers (GpuModel::Impl::AllocateFp8Experts) at V4-Flash shapes, one
// GPU, W8A16, 8192 rows (a prefill_chunk of 8192): the bf16 outputs of 6 picks a row, and the
// workspace of the largest call, 8192 tokens' gate_up on the wgmma path (49152 picks > 64 per
// expert: 128-entry work items), by hand from kernels/cuda/moe_gemm_workspace.h's layout:
// entry_pick, 640 work items of 12 bytes, the counts, the bf16 grouped rows [picks, hidden].
// At the default 256 rows (1536 picks) only the mma path runs: no grouped rows.
TEST(MemoryPlanTest, Fp8ExpertBuffersByHand) {
  auto config = ModelConfig::Load(FlashDir());
  ASSERT_TRUE(config.ok()) << config.status();
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t picks = 8192 * 6;
  const Fp8ExpertBytes big = GpuFp8ExpertBytes(*config, 8192, 1, /*w8a16=*/true);
  EXPECT_EQ(big.outputs, 2 * picks * (3 * 2048 + 4096));
  EXPECT_EQ(big.workspace,
            align(picks * 4) + align((256 + picks / 128) * 12) + 256 + align(picks * 4096 * 2));
  // W8A8 quantizes the rows first: e4m3 x and grouped rows plus their fp32 scales.
  const Fp8ExpertBytes w8a8 = GpuFp8ExpertBytes(*config, 8192, 1, /*w8a16=*/false);
  EXPECT_EQ(w8a8.workspace, align(picks * 4) + align((256 + picks / 128) * 12) + 256 +
                                align(8192 * 4096) + align(8192 * 32 * 4) + align(picks * 4096) +
                                align(picks * 32 * 4));
  const Fp8ExpertBytes small = GpuFp8ExpertBytes(*config, 256, 1, /*w8a16=*/true);
  EXPECT_LT(small.workspace, 1 << 20);
  std::printf(
      "V4-Flash FP8 experts, one GPU, W8A16: 256 rows %lld + %lld bytes, 8192 rows %lld + "
      "%lld bytes (outputs + workspace)\n",
      static_cast<long long>(small.outputs), static_cast<long long>(small.workspace),
      static_cast<long long>(big.outputs), static_cast<long long>(big.workspace));
  // Counted only where the experts are resident FP8: `weights: fp8` on a quantized checkpoint.
  auto w = PlanWeightBytes(FlashDir(), *config);
  ASSERT_TRUE(w.ok()) << w.status();
  PlanRequest q{.worker = "prefill-0", .prefill = true, .world = 4, .max_context = 4096};
  EXPECT_EQ(FormatPlan(*config, *w, q).find("FP8 experts"), std::string::npos);
  q.fp8_weights = true;
  EXPECT_NE(FormatPlan(*config, *w, q).find("FP8 experts: outputs + workspace"), std::string::npos);
  EXPECT_EQ(PlanGpu(*config, w->experts_fp8, w->replicated_fp8, q).fp8_experts, 0);
  q.fp8_experts = true;
  EXPECT_EQ(PlanGpu(*config, w->experts_fp8, w->replicated_fp8, q).fp8_experts,
            GpuFp8ExpertBytes(*config, 256, 4, true).total());
}

// engine/paged_state_plan.h: the CUDA engine's paged state pools.
namespace pdserve::engine {
namespace {

TEST(PagedStatePlanTest, FullPagesCostWhatTheSlotLayoutCosts) {
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(config.ok()) << config.status();
  const PagedStateBytes b = GpuPagedStateBytes(*config);
  // kjv-v4-tiny: CSA rate 4 (entries + indexer keys), HCA rate 32.
  ASSERT_EQ(b.page_bytes.size(), 2u);
  EXPECT_EQ(b.page_bytes[0].first, 4);
  EXPECT_EQ(b.page_bytes[1].first, 32);
  // At a context filling whole pages of every rate, a request's paged bytes are its slot's.
  for (int64_t context : {int64_t{32 * 64}, int64_t{32 * 64 * 4}}) {
    const SlotStateBytes slot = GpuSlotStateBytes(*config, context);
    EXPECT_EQ(b.per_slot, slot.window + slot.rings);
    EXPECT_EQ(b.Request(context), slot.total()) << context;
  }
  // Fewer tokens: only their pages (3 tokens: no entry yet, the fixed part only).
  EXPECT_EQ(b.Request(3), b.per_slot);
  EXPECT_EQ(b.Request(4), b.per_slot + b.page_bytes[0].second);
  EXPECT_EQ(b.Request(32), b.per_slot + b.page_bytes[0].second + b.page_bytes[1].second);
}

TEST(PagedStatePlanTest, PoolsFollowStateTokensAndNeverExceedTheSlotLayout) {
  EXPECT_EQ(PagedPoolPages(4, 8, 4096, 0), 8 * 16);         // 1024 entries a slot: 16 pages
  EXPECT_EQ(PagedPoolPages(4, 8, 4096, 8 * 1000), 32 + 8);  // 2000 entries: 32 pages + slack
  EXPECT_EQ(PagedPoolPages(4, 8, 4096, 1 << 30), 8 * 16);   // capped at the slot layout
  EXPECT_EQ(PagedPoolPages(128, 2, 100, 0), 2);             // at least one page a slot
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(GpuStatePoolBytes(*config, 8, 512, 0, false),
            GpuStatePoolBytes(*config, 8, 512, 0, true));
  EXPECT_LT(GpuStatePoolBytes(*config, 8, 512, 8 * 100, true),
            GpuStatePoolBytes(*config, 8, 512, 8 * 100, false));
}

TEST(PagedStatePlanTest, FlashCapacityGrowsForShortRequestsOnly) {
  auto flash =
      ModelConfig::Load(std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/v4_configs/flash");
  ASSERT_TRUE(flash.ok()) << flash.status();
  const int64_t budget = kH200Bytes - kRuntimeAllowance;
  const int64_t max_context = 131072;
  const int64_t slot_layout = ConcurrentRequestsThatFit(*flash, 8192, max_context, budget, false);
  ASSERT_GT(slot_layout, 0);
  // The slot layout does not depend on the requests' length.
  EXPECT_EQ(ConcurrentRequestsThatFit(*flash, 131072, max_context, budget, false), slot_layout);
  const int64_t paged8k = ConcurrentRequestsThatFit(*flash, 8192, max_context, budget, true);
  const int64_t paged128k = ConcurrentRequestsThatFit(*flash, 131072, max_context, budget, true);
  EXPECT_GT(paged8k, 8 * slot_layout);  // 16x fewer tokens, less the fixed part per request
  EXPECT_GE(paged128k, slot_layout);
  EXPECT_LE(paged128k, slot_layout + 1);
  // The answer is the largest count that fits.
  EXPECT_LE(GpuStatePoolBytes(*flash, paged8k, max_context, paged8k * 8192, true), budget);
  EXPECT_GT(GpuStatePoolBytes(*flash, paged8k + 1, max_context, (paged8k + 1) * 8192, true),
            budget);
}

}  // namespace
}  // namespace pdserve::engine

TEST(PagedStatePlanTest, AdmissionLedgerCountsThePoolsAndARequestsPages) {
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(config.ok());
  const auto kinds = PagedPoolKinds(*config, 8, 4096, 8 * 1000);
  const auto bytes = GpuPagedStateBytes(*config).page_bytes;
  ASSERT_EQ(kinds.size(), bytes.size());
  for (size_t i = 0; i < kinds.size(); ++i) {
    EXPECT_EQ(kinds[i].first, bytes[i].first);
    EXPECT_EQ(kinds[i].second, PagedPoolPages(kinds[i].first, 8, 4096, 8 * 1000));
  }
  EXPECT_EQ(PagedRequestPages(4, 4096, 0), 0);
  EXPECT_EQ(PagedRequestPages(4, 4096, 3), 0);    // no entry yet
  EXPECT_EQ(PagedRequestPages(4, 4096, 4), 1);    // the first entry takes a page
  EXPECT_EQ(PagedRequestPages(4, 4096, 256), 1);  // 64 entries: one full page
  EXPECT_EQ(PagedRequestPages(4, 4096, 260), 2);  // the 65th entry opens the second
  EXPECT_EQ(PagedRequestPages(4, 4096, 4096), 16);
  EXPECT_EQ(PagedRequestPages(4, 4096, 1 << 20), 16);  // capped at the slot's capacity
}

TEST(PagedStatePlanTest, AdmittedRequestsIsTheSmallestPoolsShareCappedAtTheSlots) {
  auto config = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);  // rates 4 and 32, context 512
  ASSERT_TRUE(config.ok());
  // state_tokens 1 on 8 slots: 8 pages a rate. 410 tokens: 2 rate-4 pages (102 entries), 1
  // rate-32 page: 4 at once.
  EXPECT_EQ(AdmittedRequests(*config, 8, 512, 1, 410), 4);
  EXPECT_EQ(AdmittedRequests(*config, 8, 512, 1, 200), 8);  // 1 page each: the slots bound
  EXPECT_EQ(AdmittedRequests(*config, 8, 512, 0, 512), 8);  // full pools: every slot
  EXPECT_EQ(AdmittedRequests(*config, 8, 512, 1, 513), 0);  // over max_context
  EXPECT_EQ(AdmittedRequests(*config, 1, 512, 1, 410), 0);  // 1 page a rate: never fits
}

}  // namespace
}  // namespace pdserve::engine
