// The CUDA launchers' argument checks name the argument and the check that failed
// (kernels/cuda/launch_check.h). Every refusal here happens before any CUDA runtime call, so this
// runs on machines without a GPU (no `gpu` label). The pointers are host addresses that a refused
// launcher never dereferences.
#include "kernels/cuda/launch_check.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/compressor.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/hyper_connection.cuh"
#include "kernels/cuda/indexer.cuh"
#include "kernels/cuda/indexer_generic.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/page_copy.cuh"
#include "kernels/cuda/rms_norm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/sink_attention.cuh"
#include "kernels/cuda/sinkhorn.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/topk.cuh"
#include "kernels/cuda/xxh3.cuh"

namespace pdserve::kernels::cuda {
namespace {

struct Refusal {
  const char* name;
  std::function<cudaError_t()> launch;
  std::string expected;  // TakeLaunchRefusal() afterwards
};

// Host memory standing in for device buffers: 16-byte aligned, never read by a refused launcher.
alignas(16) float f32[64];
alignas(16) int32_t i32[64];
alignas(16) __nv_bfloat16 bf16[64];
alignas(16) uint8_t u8[64];

SparseDecodeParams ValidSparse() {
  SparseDecodeParams p;
  p.q = bf16;
  p.batch = 1;
  p.window_pool = bf16;
  p.window_page = i32;
  p.window_len = i32;
  p.n_compressed = i32;
  p.sinks = f32;
  return p;
}

CompressorParams ValidCompressor() {
  CompressorParams p;
  p.kv = f32;
  p.gate = f32;
  p.dim = 8;
  p.rate = 4;
  p.first_position = i32;
  p.n_tokens = i32;
  p.row_offset = i32;
  p.slot = i32;
  p.segments = 1;
  p.max_tokens = 4;
  p.ring_kv = f32;
  p.ring_gate = f32;
  p.position_bias = f32;
  p.norm_weight = f32;
  return p;
}

std::vector<Refusal> Refusals() {
  return {
      {"rms_norm_stride", [] { return rms_norm(f32, nullptr, 2, 8, 4, 1e-6f, f32, nullptr); },
       "rms_norm: argument check failed: stride >= dim"},
      {"rms_norm_null_x", [] { return rms_norm(nullptr, nullptr, 2, 8, 8, 1e-6f, f32, nullptr); },
       "rms_norm: argument check failed: x != nullptr"},
      {"clamped_swiglu_out_stride",
       [] { return clamped_swiglu(f32, f32, 2, 8, 8, 7.0f, f32, 4, nullptr); },
       "clamped_swiglu: argument check failed: out_stride >= cols"},
      {"act_quant_k",
       [] {
         return act_quant(bf16, 2, 200, 256, false, u8, f32, ActScaleLayout::kColumnMajor,
                          ActQuantVariant::kWarpPerBlock, nullptr);
       },
       "act_quant: argument check failed: k > 0 && k % kActQuantBlock == 0"},
      {"act_quant_vectorized_stride",
       [] {
         return act_quant(bf16, 2, 128, 132, false, u8, f32, ActScaleLayout::kGemmSplit,
                          ActQuantVariant::kHalfWarpVectorized, nullptr);
       },
       "act_quant: argument check failed: Aligned(x, 16) && x_stride % 8 == 0"},
      {"act_quant_f32_y_stride",
       [] {
         return act_quant_f32(f32, 1, 128, 128, false, bf16, 64, u8, f32,
                              ActScaleLayout::kColumnMajor, nullptr);
       },
       "act_quant_f32: argument check failed: y_stride >= k && y_stride % 8 == 0"},
      {"act_quant_f32_group_cols",
       [] {
         return act_quant_f32(f32, 1, 384, 384, false, nullptr, 0, u8, f32,
                              ActScaleLayout::kColumnMajor, nullptr, 256);
       },
       "act_quant_f32: argument check failed: group_cols % kActQuantBlock == 0 && k % group_cols "
       "== 0"},
      {"clamped_swiglu_act_quant_in_stride",
       [] {
         return clamped_swiglu_act_quant(f32, f32, 1, 128, 130, 7.0f, false, nullptr, 0, u8, f32,
                                         ActScaleLayout::kColumnMajor, nullptr);
       },
       "clamped_swiglu_act_quant: argument check failed: in_stride % 4 == 0"},
      {"clamped_swiglu_act_quant_cols",
       [] {
         return clamped_swiglu_act_quant(f32, f32, 1, 64, 128, 7.0f, false, nullptr, 0, u8, f32,
                                         ActScaleLayout::kColumnMajor, nullptr);
       },
       "clamped_swiglu_act_quant: argument check failed: cols > 0 && cols % kActQuantBlock == 0"},
      {"top_k_k", [] { return top_k(f32, 1, 8, i32, 0, i32, nullptr); },
       "top_k: argument check failed: k >= 1"},
      {"top_k_split_not_power_of_two",
       [] { return top_k_split(f32, 1, 8, i32, 4, 3, i32, nullptr); },
       "top_k: argument check failed: (blocks_per_row & (blocks_per_row - 1)) == 0"},
      {"top_k_split_past_cluster", [] { return top_k_split(f32, 1, 8, i32, 4, 16, i32, nullptr); },
       "top_k: argument check failed: blocks_per_row <= kMaxTopKBlocks"},
      {"sinkhorn_n", [] { return sinkhorn_project(f32, 1, 0, 20, 1e-6f, nullptr); },
       "sinkhorn_project: argument check failed: n >= 1"},
      {"rope_odd",
       [] { return apply_interleaved_rope(f32, 1, 8, 1, 8, 3, i32, f32, 1.0f, false, nullptr); },
       "apply_interleaved_rope: argument check failed: rope_dim % 2 == 0"},
      {"sink_attention_head_dim",
       [] {
         SinkAttentionParams p;
         p.rows = 1;
         p.heads = 1;
         p.head_dim = 2048;
         p.window = 4;
         return sink_attention(p, f32, nullptr);
       },
       "sink_attention: argument check failed: p.head_dim <= 1024"},
      {"sparse_heads",
       [] {
         SparseDecodeParams p = ValidSparse();
         p.heads = 65;
         return sparse_decode_attention(p, f32, sizeof(f32), bf16, nullptr);
       },
       "sparse_decode_attention: argument check failed: p.heads % kHeads == 0"},
      {"sparse_workspace",
       [] { return sparse_decode_attention(ValidSparse(), f32, 16, bf16, nullptr); },
       "sparse_decode_attention: argument check failed: workspace_bytes >= "
       "SparseDecodeWorkspaceBytes(p)"},
      {"indexer_page_size",
       [] {
         IndexerParams p;
         p.page_size = 0;
         return indexer_scores(p, f32, i32, nullptr);
       },
       "indexer_scores: argument check failed: p.page_size >= 1"},
      {"indexer_generic_heads",
       [] {
         return indexer_scores_generic(f32, f32, 1, 0, 8, bf16, 4, i32, i32, 4, 1.0f, 4, f32, i32,
                                       nullptr);
       },
       "indexer_scores_generic: argument check failed: heads >= 1"},
      {"compressor_rope_dim",
       [] {
         CompressorParams p = ValidCompressor();
         p.rope_dim = 3;
         return compressor_update(p, nullptr);
       },
       "compressor_update: argument check failed: p.rope_dim % 2 == 0"},
      {"compressor_ring_gate",
       [] {
         CompressorParams p = ValidCompressor();
         p.ring_gate = nullptr;
         return compressor_update(p, nullptr);
       },
       "compressor_update: argument check failed: p.ring_gate != nullptr"},
      {"hyper_connection_post_hc",
       [] { return hyper_connection_post(f32, f32, f32, 1, 0, 8, f32, nullptr); },
       "hyper_connection_post: argument check failed: hc >= 1"},
      {"hyper_head_out",
       [] { return hyper_head(f32, f32, 1, 4, 8, f32, f32, 1e-6f, nullptr, nullptr); },
       "hyper_head: argument check failed: out != nullptr"},
      {"moe_route_scoring",
       [] {
         return moe_route(f32, 1, 8, 2, static_cast<MoeScoring>(7), nullptr, nullptr, nullptr, 1.0f,
                          i32, f32, nullptr);
       },
       "moe_route: argument check failed: scoring == MoeScoring::kSoftmax || scoring == "
       "MoeScoring::kSigmoid || scoring == MoeScoring::kSqrtSoftplus"},
      {"moe_experts_k",
       [] {
         return moe_experts(bf16, 1, 8, 8, 0, 4, bf16, bf16, i32, f32, 7.0f, f32, sizeof(f32), f32,
                            nullptr);
       },
       "moe_experts: argument check failed: k >= 1"},
      {"moe_experts_alignment",
       [] {
         const size_t bytes = moe_experts_workspace_bytes(1, 1, 8);
         std::vector<unsigned char> workspace(bytes + 16);
         void* misaligned =
             workspace.data() + (reinterpret_cast<uintptr_t>(workspace.data()) % 16 ? 0 : 1);
         return moe_experts(bf16, 1, 8, 8, 1, 4, bf16, bf16, i32, f32, 7.0f, misaligned, bytes, f32,
                            nullptr);
       },
       "moe_experts: argument check failed: Aligned16(workspace)"},
      {"xxh3_pages_count", [] { return xxh3_64_pages(nullptr, -1, nullptr, nullptr); },
       "xxh3_64_pages: argument check failed: num_pages >= 0"},
      {"xxh3_pages_null",
       [] { return xxh3_64_pages(nullptr, 3, reinterpret_cast<uint64_t*>(u8), nullptr); },
       "xxh3_64_pages: argument check failed: pages != nullptr"},
      {"copy_pages_count", [] { return copy_pages(nullptr, -1, nullptr); },
       "copy_pages: argument check failed: num_pages >= 0"},
      {"copy_pages_null", [] { return copy_pages(nullptr, 2, nullptr); },
       "copy_pages: argument check failed: copies != nullptr"},
  };
}

class LaunchRefusalTest : public ::testing::TestWithParam<Refusal> {};

TEST_P(LaunchRefusalTest, NamesTheFailedCheck) {
  TakeLaunchRefusal();  // nothing left from an earlier case
  EXPECT_EQ(GetParam().launch(), cudaErrorInvalidValue);
  EXPECT_EQ(TakeLaunchRefusal(), GetParam().expected);
  EXPECT_EQ(TakeLaunchRefusal(), "") << "taking the refusal clears it";
}

INSTANTIATE_TEST_SUITE_P(Launchers, LaunchRefusalTest, ::testing::ValuesIn(Refusals()),
                         [](const ::testing::TestParamInfo<Refusal>& param_info) {
                           return std::string(param_info.param.name);
                         });

// moe_grouped_gemm_wgmma's refusals come before any CUDA call too (its own std::string refusal),
// and without PDSERVE_MOE_GEMM the dispatch takes the wgmma path from kMoeWgmmaMinPicks picks on.
TEST(MoeGemmWgmmaHostTest, RefusalsAndDispatchWithoutAGpu) {
  ExpertWeights w;
  w.format = ExpertFormat::kFp8W8A16;
  w.w = u8;
  w.scale = f32;
  w.n_experts = 256;
  w.n = 4096;
  w.k = 4096;
  const auto refusal_of = [&](const ExpertWeights& weights, int64_t tokens, size_t ws_bytes) {
    std::string refusal;
    EXPECT_EQ(moe_grouped_gemm_wgmma(bf16, 4096, false, i32, nullptr, tokens, 6, weights, false,
                                     bf16, 4096, u8, ws_bytes, nullptr, MoeWgmmaConfig{}, &refusal),
              cudaErrorInvalidValue);
    return refusal;
  };
  EXPECT_NE(refusal_of(w, 4096, 64).find("workspace_bytes:"), std::string::npos);
  EXPECT_NE(refusal_of(w, -1, 64).find("tokens:"), std::string::npos);
  ExpertWeights fp4 = w;
  fp4.format = ExpertFormat::kFp4;
  fp4.scale_e8m0 = u8;
  EXPECT_NE(refusal_of(fp4, 8, 64).find("weights.format:"), std::string::npos);
  ExpertWeights wide = w;
  wide.n_experts = 1024;
  wide.n = 4194240;
  EXPECT_NE(refusal_of(wide, 8, 64).find("TMA coordinates"), std::string::npos);
  // W8A16 at 4096 tokens: at least the grouped bf16 rows (picks x k x 2 bytes).
  EXPECT_GE(moe_grouped_gemm_wgmma_workspace_bytes(4096, 6, 4096, w), size_t{24576} * 4096 * 2);
  EXPECT_EQ(moe_grouped_gemm_wgmma_workspace_bytes(4096, 6, 4096, fp4), 0u);
  EXPECT_EQ(moe_grouped_gemm_path(4096, 6, fp4), MoeGemmPath::kMma);
  if (std::getenv("PDSERVE_MOE_GEMM") == nullptr) {
    EXPECT_EQ(moe_grouped_gemm_path(8192, 6, w), MoeGemmPath::kWgmma);
    EXPECT_EQ(moe_grouped_gemm_path(kMoeWgmmaMinPicks / 6, 6, w), MoeGemmPath::kMma);
    EXPECT_EQ(moe_grouped_gemm_path(1, 6, w), MoeGemmPath::kMma);  // decode sizes
    EXPECT_EQ(moe_grouped_gemm_workspace_bytes(4096, 6, 4096, w),
              std::max(moe_grouped_gemm_mma_workspace_bytes(4096, 6, 4096, w),
                       moe_grouped_gemm_wgmma_workspace_bytes(4096, 6, 4096, w)));
  }
}

TEST(LaunchCheckTest, EmptyWorkIsNoRefusal) {
  TakeLaunchRefusal();
  EXPECT_EQ(rms_norm(static_cast<const float*>(nullptr), nullptr, 0, 8, 8, 1e-6f, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(TakeLaunchRefusal(), "");
  EXPECT_EQ(xxh3_64_pages(nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(copy_pages(nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(TakeLaunchRefusal(), "");
}

// fp8_gemm_quantized checks its arguments and workspace on the host, before any CUDA call, and
// names the failed check in `refusal`.
TEST(LaunchCheckTest, Fp8GemmQuantizedRefusesOnTheHost) {
  EXPECT_EQ(fp8_gemm_quantized_workspace_bytes(64, 128, 200), 0u);
  const size_t ws_bytes = fp8_gemm_quantized_workspace_bytes(64, 128, 256);
  EXPECT_GE(ws_bytes, kCublasLtWorkspace);
  alignas(256) static uint8_t workspace[512];
  std::string refusal;
  EXPECT_EQ(fp8_gemm_quantized(u8, f32 + 1, 64, 256, u8, f32, 128, f32, 128, workspace, ws_bytes,
                               nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_EQ(refusal, "xs: null or not 16-byte aligned");
  EXPECT_EQ(fp8_gemm_quantized(u8, f32, 64, 200, u8, f32, 128, f32, 128, workspace, ws_bytes,
                               nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_EQ(refusal, "k: not a positive multiple of 128 (200)");
  EXPECT_EQ(fp8_gemm_quantized(u8, f32, 64, 256, u8, f32, 128, f32, 128, workspace,
                               sizeof(workspace), nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_EQ(refusal.rfind("workspace_bytes: 512 < the ", 0), 0u) << refusal;
  EXPECT_EQ(fp8_gemm_quantized(nullptr, f32, 64, 256, u8, f32, 128, f32, 128, workspace, ws_bytes,
                               nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_EQ(refusal, "xq: null or not 16-byte aligned");
}

TEST(LaunchCheckTest, TheRefusalStaysOnItsThread) {
  TakeLaunchRefusal();
  ASSERT_EQ(top_k(f32, 1, 8, i32, 0, i32, nullptr), cudaErrorInvalidValue);
  std::string other = "unset";
  std::thread([&] { other = TakeLaunchRefusal(); }).join();
  EXPECT_EQ(other, "");
  EXPECT_EQ(TakeLaunchRefusal(), "top_k: argument check failed: k >= 1");
}

}  // namespace
}  // namespace pdserve::kernels::cuda
