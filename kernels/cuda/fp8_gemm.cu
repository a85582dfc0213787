#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/env_switch.h"

namespace pdserve::kernels::cuda {
namespace bs = block_scaled;

namespace fp8_gemm_internal {

cudaError_t ValidateDense(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                          const uint8_t* w, const float* w_scale, int64_t n,
                          const __nv_bfloat16* out, int64_t out_stride, std::string* refusal) {
  const auto refuse = [&](const std::string& what) { return bs::Refuse(refusal, what); };
  using bs::Aligned;
  using bs::kMaxElements;
  if (m < 0) return refuse("m: negative (" + std::to_string(m) + ")");
  if (n < 0) return refuse("n: negative (" + std::to_string(n) + ")");
  if (k <= 0 || k % bs::kBlockK != 0) {
    return refuse("k: not a positive multiple of 128 (" + std::to_string(k) + ")");
  }
  if (x_stride < k || x_stride % 8 != 0) {
    return refuse("x_stride: below k or not a multiple of 8 (" + std::to_string(x_stride) + ")");
  }
  if (n > bs::kMaxN) return refuse("n: above " + std::to_string(bs::kMaxN));
  if (m >= (int64_t{1} << 31)) return refuse("m: 2^31 or more");
  if (out_stride < n) return refuse("out_stride: below n (" + std::to_string(out_stride) + ")");
  if (!bs::ProductAtMost(m, x_stride, kMaxElements)) return refuse("x: m * x_stride >= 2^62");
  if (!bs::ProductAtMost(n, k, kMaxElements)) return refuse("w: n * k >= 2^62");
  if (!bs::ProductAtMost(m, out_stride, kMaxElements)) {
    return refuse("out: m * out_stride >= 2^62");
  }
  if (m == 0 || n == 0) return cudaSuccess;
  if (x == nullptr || !Aligned(x, 16)) return refuse("x: null or not 16-byte aligned");
  if (w == nullptr || !Aligned(w, 16)) return refuse("w: null or not 16-byte aligned");
  if (w_scale == nullptr || !Aligned(w_scale, 4)) {
    return refuse("w_scale: null or not 4-byte aligned");
  }
  if (out == nullptr || !Aligned(out, 16)) return refuse("out: null or not 16-byte aligned");
  return cudaSuccess;
}

cudaError_t CheckWorkspace(const void* workspace, size_t workspace_bytes, size_t needed,
                           std::string* refusal) {
  if (workspace_bytes < needed) {
    return bs::Refuse(refusal, "workspace_bytes: " + std::to_string(workspace_bytes) + " < the " +
                                   std::to_string(needed) + " needed");
  }
  if (workspace == nullptr || !bs::Aligned(workspace, 256)) {
    return bs::Refuse(refusal, "workspace: null or not 256-byte aligned");
  }
  return cudaSuccess;
}

}  // namespace fp8_gemm_internal

namespace {

using bs::Aligned;
using bs::kMaxElements;
using fp8_gemm_internal::CheckWorkspace;
using fp8_gemm_internal::ValidateDense;

// Workspace and its plans (DensePlan, LtPlan): fp8_gemm_workspace.h, shared with the memory plan.
// W8A16 with one token tile reduces its k splits in the kernel (GemmArgs::cluster_reduce; H200,
// 2026-12-04: 1.05-1.25x faster at 1-8 tokens on wo_b, w13, w2; slower with two or more token
// tiles, and for W8A8 behind its act-quant kernel 1.25-1.5x slower, so not there).
using fp8_workspace::DensePlan;
using fp8_workspace::LtPlan;
using fp8_workspace::PlanDense;
using fp8_workspace::PlanLt;
static_assert(fp8_workspace::kMmaClusterSplits == bs::kMaxClusterSplits);
static_assert(fp8_workspace::kMmaRowsPerBlock == bs::kRowsPerBlock);
static_assert(fp8_workspace::kBlockK == bs::kBlockK);

bool SizesValid(int64_t m, int64_t n, int64_t k) {
  return m >= 0 && n >= 0 && k > 0 && k % bs::kBlockK == 0 &&
         bs::ProductAtMost(m, k, kMaxElements) && bs::ProductAtMost(n, k, kMaxElements) &&
         bs::ProductAtMost(16 * m, n, kMaxElements);
}

// The GemmArgs of one dense product (each row its own, k split as `plan` says); the caller sets
// the activations (xq / xs quantized, or xb / xb_stride bf16).
bs::GemmArgs DenseArgs(const uint8_t* w, const float* w_scale, int64_t m, int64_t n, int64_t k,
                       const DensePlan& plan, float* partial, __nv_bfloat16* out, float* out_f32,
                       int64_t out_stride) {
  bs::GemmArgs a{};
  a.w = w;
  a.w_scale = w_scale;
  a.x_rows = m;
  a.n = n;
  a.k = k;
  a.dense_rows = m;
  a.x_row_div = 1;
  a.k_splits = plan.splits;
  a.cluster_reduce = plan.cluster_reduce ? 1 : 0;
  a.partial = partial;
  a.out_rows = m;
  a.out = out;
  a.out_f32 = out_f32;
  a.out_stride = out_stride;
  return a;
}

}  // namespace

// fp8_workspace::W8a8Bytes for the sizes fp8_gemm takes (the wgmma part 0 past its limits).
size_t fp8_gemm_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  if (!SizesValid(m, n, k)) return 0;
  const size_t mma = PlanDense(m, n, k, false).total();
  const size_t wgmma = fp8_gemm_wgmma_workspace_bytes(m, n, k, fp8_gemm_wgmma_default_config());
  const size_t lt =
      fp8_gemm_path(m) == Fp8GemmPath::kCublasLt ? fp8_gemm_cublaslt_workspace_bytes(m, n, k) : 0;
  return std::max({mma, wgmma, lt});
}

const std::string& fp8_gemm_forced_path() {
  static const std::string forced = ReadSwitch<const char*>(
      "PDSERVE_FP8_GEMM",
      {{"auto", ""}, {"mma", "mma"}, {"wgmma", "wgmma"}, {"cublaslt", "cublaslt"}, {"own", "own"}},
      "", "the default (the path by token count)");
  return forced;
}

Fp8GemmPath fp8_gemm_path(int64_t m) { return fp8_workspace::PathFor(m, fp8_gemm_forced_path()); }

Fp8GemmPath fp8_gemm_w8a16_path(int64_t m) {
  const Fp8GemmPath forced = fp8_gemm_path(0);  // kMma unless PDSERVE_FP8_GEMM=wgmma/cublaslt
  if (forced == Fp8GemmPath::kWgmma) return forced;
  if (fp8_gemm_path(kFp8MmaMaxTokens + 1) == Fp8GemmPath::kMma) return Fp8GemmPath::kMma;  // =mma
  return m <= kW8a16MmaMaxTokens ? Fp8GemmPath::kMma : Fp8GemmPath::kWgmma;
}

namespace {

// fp8_gemm's cuBLASLt handle for the current device, created on first use and kept for the
// process (nullptr when cuBLASLt cannot create one). Thread-safe.
cublasLtHandle_t SharedLtHandle() {
  static std::mutex mu;
  static std::array<cublasLtHandle_t, 64> handles{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 ||
      device >= static_cast<int>(handles.size())) {
    (void)cudaGetLastError();
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (handles[device] == nullptr && cublasLtCreate(&handles[device]) != CUBLAS_STATUS_SUCCESS) {
    handles[device] = nullptr;
  }
  return handles[device];
}

}  // namespace

cudaError_t fp8_gemm_prepare() {
  return SharedLtHandle() != nullptr ? cudaSuccess : cudaErrorNotSupported;
}

namespace {

cudaError_t MmaPath(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                    const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                    __nv_bfloat16* out, float* out_f32, int64_t out_stride, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream, std::string* refusal);
cudaError_t LtPath(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                   int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                   bool ue8m0_act_scale, __nv_bfloat16* out, float* out_f32, int64_t out_stride,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   std::string* refusal);

// fp8_gemm for either output type (out_f32 set: fp32 there).
cudaError_t Dispatch(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                     __nv_bfloat16* out, float* out_f32, int64_t out_stride, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  const Fp8GemmPath path = fp8_gemm_path(m);
  // cuBLASLt from kFp8LtMinTokens tokens, for n a multiple of 128; the wgmma path when it cannot.
  const bool use_lt = path == Fp8GemmPath::kCublasLt && n % kFp8LtRowBlock == 0 &&
                      out_stride % 8 == 0 &&
                      workspace_bytes >= fp8_gemm_cublaslt_workspace_bytes(m, n, k);
  const bool wgmma = (path == Fp8GemmPath::kWgmma || (path == Fp8GemmPath::kCublasLt && !use_lt)) &&
                     SizesValid(m, n, k) &&
                     fp8_gemm_wgmma_workspace_bytes(m, n, k, fp8_gemm_wgmma_default_config()) > 0;
  const Fp8WgmmaConfig& config = fp8_gemm_wgmma_default_config();
  const auto run_wgmma = [&] {
    return out_f32 != nullptr
               ? fp8_gemm_wgmma(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out_f32,
                                out_stride, workspace, workspace_bytes, stream, config, refusal)
               : fp8_gemm_wgmma(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, out_stride,
                                workspace, workspace_bytes, stream, config, refusal);
  };
  if (wgmma) return run_wgmma();
  if (use_lt) {
    const cublasLtHandle_t lt = SharedLtHandle();
    if (lt != nullptr) {
      const cudaError_t status =
          LtPath(lt, x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, out_f32, out_stride,
                 workspace, workspace_bytes, stream, refusal);
      if (status != cudaErrorNotSupported) return status;
      (void)cudaGetLastError();  // no algorithm for this size or output type: our kernels
      if (refusal != nullptr) refusal->clear();
      if (SizesValid(m, n, k) && fp8_gemm_wgmma_workspace_bytes(m, n, k, config) > 0) {
        return run_wgmma();
      }
    }
  }
  return MmaPath(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, out_f32, out_stride,
                 workspace, workspace_bytes, stream, refusal);
}

}  // namespace

cudaError_t fp8_gemm(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                     __nv_bfloat16* out, int64_t out_stride, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  return Dispatch(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, nullptr, out_stride,
                  workspace, workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                     float* out, int64_t out_stride, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream, std::string* refusal) {
  return Dispatch(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, nullptr, out, out_stride,
                  workspace, workspace_bytes, stream, refusal);
}

namespace {

cudaError_t MmaPath(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                    const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                    __nv_bfloat16* out, float* out_f32, int64_t out_stride, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  cudaError_t status =
      ValidateDense(x, m, k, x_stride, w, w_scale, n, fp8_gemm_internal::OutForChecks(out, out_f32),
                    out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  const DensePlan plan = PlanDense(m, n, k, false);
  status = CheckWorkspace(workspace, workspace_bytes, plan.total(), refusal);
  if (status != cudaSuccess) return status;
  uint8_t* base = static_cast<uint8_t*>(workspace);
  uint8_t* xq = base;
  float* xs = reinterpret_cast<float*>(base + plan.xq_bytes);
  float* partial = reinterpret_cast<float*>(base + plan.xq_bytes + plan.xs_bytes);
  status = bs::LaunchActQuant(x, m, k, x_stride, ue8m0_act_scale, xq, xs, stream);
  if (status != cudaSuccess) return status;
  bs::GemmArgs a = DenseArgs(w, w_scale, m, n, k, plan, partial, out, out_f32, out_stride);
  a.xq = xq;
  a.xs = xs;
  status = bs::LaunchGemm<false>(a, plan.tiles, plan.items, stream);
  if (status != cudaSuccess || plan.splits == 1) return status;
  return bs::LaunchReduce(partial, plan.splits, m, n, nullptr, nullptr, 0, out, out_stride, stream,
                          out_f32);
}

// fp8_gemm_w8a16_mma for either output type.
cudaError_t MmaA16Path(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                       const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                       float* out_f32, int64_t out_stride, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream, std::string* refusal) {
  cudaError_t status =
      ValidateDense(x, m, k, x_stride, w, w_scale, n, fp8_gemm_internal::OutForChecks(out, out_f32),
                    out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  const DensePlan plan = PlanDense(m, n, k, true);
  if (plan.partial_bytes > 0) {
    status = CheckWorkspace(workspace, workspace_bytes, plan.partial_bytes, refusal);
    if (status != cudaSuccess) return status;
  }
  float* partial = static_cast<float*>(workspace);
  bs::GemmArgs a = DenseArgs(w, w_scale, m, n, k, plan, partial, out, out_f32, out_stride);
  a.xb = x;
  a.xb_stride = x_stride;
  status = bs::LaunchGemm<false, true>(a, plan.tiles, plan.items, stream);
  if (status != cudaSuccess || plan.splits == 1 || plan.cluster_reduce) return status;
  return bs::LaunchReduce(partial, plan.splits, m, n, nullptr, nullptr, 0, out, out_stride, stream,
                          out_f32);
}

// fp8_gemm_w8a16 for either output type.
cudaError_t DispatchA16(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                        const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                        float* out_f32, int64_t out_stride, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, std::string* refusal) {
  if (fp8_gemm_w8a16_path(m) == Fp8GemmPath::kWgmma && SizesValid(m, n, k)) {
    const Fp8WgmmaConfig& config = fp8_gemm_wgmma_default_config();
    return out_f32 != nullptr
               ? fp8_gemm_w8a16_wgmma(x, m, k, x_stride, w, w_scale, n, out_f32, out_stride,
                                      workspace, workspace_bytes, stream, config, refusal)
               : fp8_gemm_w8a16_wgmma(x, m, k, x_stride, w, w_scale, n, out, out_stride, workspace,
                                      workspace_bytes, stream, config, refusal);
  }
  return MmaA16Path(x, m, k, x_stride, w, w_scale, n, out, out_f32, out_stride, workspace,
                    workspace_bytes, stream, refusal);
}

}  // namespace

cudaError_t fp8_gemm_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                         const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                         __nv_bfloat16* out, int64_t out_stride, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  return MmaPath(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, nullptr, out_stride,
                 workspace, workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                         const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                         float* out, int64_t out_stride, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream, std::string* refusal) {
  return MmaPath(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, nullptr, out, out_stride,
                 workspace, workspace_bytes, stream, refusal);
}

size_t fp8_gemm_w8a16_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  if (!SizesValid(m, n, k)) return 0;
  return std::max(PlanDense(m, n, k, true).partial_bytes,
                  fp8_gemm_w8a16_wgmma_workspace_bytes(m, n, k, fp8_gemm_wgmma_default_config()));
}

cudaError_t fp8_gemm_w8a16(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                           int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, std::string* refusal) {
  return DispatchA16(x, m, k, x_stride, w, w_scale, n, out, nullptr, out_stride, workspace,
                     workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_w8a16(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, float* out,
                           int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, std::string* refusal) {
  return DispatchA16(x, m, k, x_stride, w, w_scale, n, nullptr, out, out_stride, workspace,
                     workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_w8a16_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                               const uint8_t* w, const float* w_scale, int64_t n,
                               __nv_bfloat16* out, int64_t out_stride, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  return MmaA16Path(x, m, k, x_stride, w, w_scale, n, out, nullptr, out_stride, workspace,
                    workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_w8a16_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                               const uint8_t* w, const float* w_scale, int64_t n, float* out,
                               int64_t out_stride, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, std::string* refusal) {
  return MmaA16Path(x, m, k, x_stride, w, w_scale, n, nullptr, out, out_stride, workspace,
                    workspace_bytes, stream, refusal);
}

// ---------------------------------------------------------------------------------------------
// cuBLASLt. Column-major view: out^T [n, m] = W^T' [n, k] x xq^T [k, m], i.e. A = w stored as a
// column-major [k, n] matrix with op T, B = xq stored column-major [k, m] with op N (the "TN"
// layout FP8 requires). A's scales: BLK128x128 over [n/128, k/128] with k fastest (DeepSeek's
// layout); B's: VEC128 [k/128, m] with m fastest (what the act-quant kernel writes).
//
// cuBLASLt reads the BLK128x128 weight scales with a leading dimension of round_up(k / 128, 4)
// (16-byte aligned rows; PyTorch's _scaled_mm pads its 128 x 128 scales the same way), and the
// VEC128 activation scales [k / 128, m] with m fastest, where m must be a multiple of 4 (it has
// no algorithm otherwise). With DeepSeek's unpadded [n / 128, k / 128] scales at k / 128 = 2,
// it read the wrong scales: m = 64 x n = 2048 x k = 256 gave a normalized error of 1.04 on the
// H200 (2026-12-04). So fp8_gemm_cublaslt runs the first m & ~3 rows through cuBLASLt with the
// weight scales copied to a padded buffer when k / 128 is not a multiple of 4, and the last
// m % 4 rows through fp8_gemm_mma (LtPlan, fp8_gemm_workspace.h).

size_t fp8_gemm_cublaslt_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  if (!SizesValid(m, n, k)) return 0;
  return PlanLt(m, n, k).total();
}

namespace {

// Owns the cuBLASLt descriptors of one call.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr;
  cublasLtMatrixLayout_t b = nullptr;
  cublasLtMatrixLayout_t d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescriptors() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

cudaError_t LtFailed(std::string* refusal, const char* step, cublasStatus_t status) {
  if (refusal != nullptr) {
    *refusal = std::string("cuBLASLt ") + step + ": status " + std::to_string(status);
  }
  return cudaErrorNotSupported;
}

#define PDSERVE_LT(step, expr)                                                         \
  do {                                                                                 \
    const cublasStatus_t lt_status = (expr);                                           \
    if (lt_status != CUBLAS_STATUS_SUCCESS) return LtFailed(refusal, step, lt_status); \
  } while (0)

cudaError_t LtMatmul(cublasLtHandle_t handle, const uint8_t* xq, const float* xs, int64_t m,
                     int64_t k, const uint8_t* w, const float* w_scale, int64_t n, void* out,
                     bool out_f32, int64_t out_stride, void* lt_workspace, cudaStream_t stream,
                     std::string* refusal) {
  LtDescriptors desc;
  PDSERVE_LT("create op", cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const void* scale_a = w_scale;
  const void* scale_b = xs;
  const auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
    return cublasLtMatmulDescSetAttribute(desc.op, attr, v, size);
  };
  PDSERVE_LT("transa", set(CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  PDSERVE_LT("transb", set(CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  PDSERVE_LT("a scale mode", set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
  PDSERVE_LT("b scale mode", set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  PDSERVE_LT("a scale", set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)));
  PDSERVE_LT("b scale", set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)));
  PDSERVE_LT("layout a", cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_8F_E4M3, k, n, k));
  PDSERVE_LT("layout b", cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_8F_E4M3, k, m, k));
  PDSERVE_LT("layout d", cublasLtMatrixLayoutCreate(&desc.d, out_f32 ? CUDA_R_32F : CUDA_R_16BF, n,
                                                    m, out_stride));
  PDSERVE_LT("preference", cublasLtMatmulPreferenceCreate(&desc.pref));
  const size_t ws_bytes = kCublasLtWorkspace;
  PDSERVE_LT("preference workspace",
             cublasLtMatmulPreferenceSetAttribute(
                 desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  PDSERVE_LT("heuristic", cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d,
                                                         desc.d, desc.pref, 1, &heuristic, &found));
  if (found == 0) return LtFailed(refusal, "heuristic (no algorithm)", CUBLAS_STATUS_NOT_SUPPORTED);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  PDSERVE_LT("matmul",
             cublasLtMatmul(handle, desc.op, &alpha, w, desc.a, xq, desc.b, &beta, out, desc.d, out,
                            desc.d, &heuristic.algo, lt_workspace, ws_bytes, stream));
  return cudaGetLastError();
}

#undef PDSERVE_LT

// cuBLASLt over `rows` (a multiple of 4) quantized rows: the weight scales copied padded to
// `scratch` first when plan.repack, cuBLASLt's own workspace after them.
cudaError_t LtOnQuantized(cublasLtHandle_t handle, const LtPlan& plan, const uint8_t* xq,
                          const float* xs, int64_t rows, int64_t k, const uint8_t* w,
                          const float* w_scale, int64_t n, __nv_bfloat16* out, float* out_f32,
                          int64_t out_stride, uint8_t* scratch, cudaStream_t stream,
                          std::string* refusal) {
  const float* scales = w_scale;
  if (plan.repack) {
    float* padded = reinterpret_cast<float*>(scratch);
    const int64_t kb = k / bs::kBlockK;
    const int64_t nb = (n + kFp8LtRowBlock - 1) / kFp8LtRowBlock;
    const size_t row_bytes = static_cast<size_t>(kb) * sizeof(float);
    const size_t padded_row_bytes = static_cast<size_t>(plan.kb_padded) * sizeof(float);
    cudaError_t status =
        cudaMemsetAsync(padded, 0, static_cast<size_t>(nb) * padded_row_bytes, stream);
    if (status == cudaSuccess) {
      status = cudaMemcpy2DAsync(padded, padded_row_bytes, w_scale, row_bytes, row_bytes,
                                 static_cast<size_t>(nb), cudaMemcpyDeviceToDevice, stream);
    }
    if (status != cudaSuccess) return status;
    scales = padded;
  }
  void* d = out_f32 != nullptr ? static_cast<void*>(out_f32) : static_cast<void*>(out);
  return LtMatmul(handle, xq, xs, rows, k, w, scales, n, d, out_f32 != nullptr, out_stride,
                  scratch + plan.scale_bytes, stream, refusal);
}

cudaError_t LtPath(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                   int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                   bool ue8m0_act_scale, __nv_bfloat16* out, float* out_f32, int64_t out_stride,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   std::string* refusal) {
  cudaError_t status =
      ValidateDense(x, m, k, x_stride, w, w_scale, n, fp8_gemm_internal::OutForChecks(out, out_f32),
                    out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  if (n % 16 != 0)
    return bs::Refuse(refusal, "n: not a multiple of 16 (" + std::to_string(n) + ")");
  if (out_stride % 8 != 0) return bs::Refuse(refusal, "out_stride: not a multiple of 8");
  if (handle == nullptr) return bs::Refuse(refusal, "handle: null");
  const LtPlan plan = PlanLt(m, n, k);
  status = CheckWorkspace(workspace, workspace_bytes, plan.total(), refusal);
  if (status != cudaSuccess) return status;
  uint8_t* base = static_cast<uint8_t*>(workspace);
  if (plan.lt_rows > 0) {
    float* xs = reinterpret_cast<float*>(base + plan.xq_bytes);
    status = bs::LaunchActQuant(x, plan.lt_rows, k, x_stride, ue8m0_act_scale, base, xs, stream);
    if (status != cudaSuccess) return status;
    status = LtOnQuantized(handle, plan, base, xs, plan.lt_rows, k, w, w_scale, n, out, out_f32,
                           out_stride, base + plan.xq_bytes + plan.xs_bytes, stream, refusal);
    if (status != cudaSuccess || plan.lt_rows == m) return status;
  }
  // The last m % 4 rows (stream-ordered after cuBLASLt, so the workspace is reused).
  const int64_t tail = m - plan.lt_rows;
  const int64_t skip = plan.lt_rows * out_stride;
  return MmaPath(x + plan.lt_rows * x_stride, tail, k, x_stride, w, w_scale, n, ue8m0_act_scale,
                 out != nullptr ? out + skip : nullptr,
                 out_f32 != nullptr ? out_f32 + skip : nullptr, out_stride, workspace,
                 workspace_bytes, stream, refusal);
}

// fp8_gemm_mma's GEMM (and split-k reduction) on rows quantized beforehand ([k / 128, m] scales);
// the split-k sums at the start of the workspace.
cudaError_t MmaOnQuantized(const uint8_t* xq, const float* xs, int64_t m, int64_t k,
                           const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                           float* out_f32, int64_t out_stride, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  if (m == 0) return cudaSuccess;
  const DensePlan plan = PlanDense(m, n, k, false);
  if (plan.partial_bytes > 0) {
    const cudaError_t status =
        CheckWorkspace(workspace, workspace_bytes, plan.partial_bytes, refusal);
    if (status != cudaSuccess) return status;
  }
  float* partial = static_cast<float*>(workspace);
  bs::GemmArgs a = DenseArgs(w, w_scale, m, n, k, plan, partial, out, out_f32, out_stride);
  a.xq = xq;
  a.xs = xs;
  const cudaError_t status = bs::LaunchGemm<false>(a, plan.tiles, plan.items, stream);
  if (status != cudaSuccess || plan.splits == 1) return status;
  return bs::LaunchReduce(partial, plan.splits, m, n, nullptr, nullptr, 0, out, out_stride, stream,
                          out_f32);
}

// fp8_gemm_quantized for either output type.
cudaError_t QuantizedPath(const uint8_t* xq, const float* xs, int64_t m, int64_t k,
                          const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                          float* out_f32, int64_t out_stride, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  if (m > 0 && n > 0 && (xq == nullptr || !Aligned(xq, 16))) {
    return bs::Refuse(refusal, "xq: null or not 16-byte aligned");
  }
  // The rest as fp8_gemm's, with xq checked as a [m, k] matrix of bf16-sized elements (bounds at
  // least as strict).
  cudaError_t status =
      ValidateDense(reinterpret_cast<const __nv_bfloat16*>(xq), m, k, k, w, w_scale, n,
                    fp8_gemm_internal::OutForChecks(out, out_f32), out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  if (xs == nullptr || !Aligned(xs, 16))
    return bs::Refuse(refusal, "xs: null or not 16-byte aligned");
  status = CheckWorkspace(workspace, workspace_bytes, fp8_gemm_quantized_workspace_bytes(m, n, k),
                          refusal);
  if (status != cudaSuccess) return status;
  const LtPlan plan = PlanLt(m, n, k);
  const int64_t kb = k / bs::kBlockK;
  const int64_t m4 = plan.lt_rows;
  const uint8_t* tail_q = xq + m4 * k;
  const float* tail_s = xs + m4 * kb;
  const int64_t skip = m4 * out_stride;
  __nv_bfloat16* tail_out = out != nullptr ? out + skip : nullptr;
  float* tail_out_f32 = out_f32 != nullptr ? out_f32 + skip : nullptr;
  const auto tail = [&] {
    return MmaOnQuantized(tail_q, tail_s, m - m4, k, w, w_scale, n, tail_out, tail_out_f32,
                          out_stride, workspace, workspace_bytes, stream, refusal);
  };
  const bool use_lt = fp8_gemm_path(m) == Fp8GemmPath::kCublasLt && n % kFp8LtRowBlock == 0 &&
                      out_stride % 8 == 0 && m4 > 0;
  const cublasLtHandle_t lt = use_lt ? SharedLtHandle() : nullptr;
  if (lt != nullptr) {
    status = LtOnQuantized(lt, plan, xq, xs, m4, k, w, w_scale, n, out, out_f32, out_stride,
                           static_cast<uint8_t*>(workspace), stream, refusal);
    if (status == cudaSuccess) return m4 == m ? status : tail();
    if (status != cudaErrorNotSupported) return status;
    (void)cudaGetLastError();  // no algorithm for this size or output type: fp8_gemm_mma
    if (refusal != nullptr) refusal->clear();
  }
  status = MmaOnQuantized(xq, xs, m4, k, w, w_scale, n, out, out_f32, out_stride, workspace,
                          workspace_bytes, stream, refusal);
  if (status != cudaSuccess || m4 == m) return status;
  return tail();
}

}  // namespace

cudaError_t fp8_gemm_cublaslt(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                              int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                              bool ue8m0_act_scale, __nv_bfloat16* out, int64_t out_stride,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream,
                              std::string* refusal) {
  return LtPath(handle, x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, nullptr, out_stride,
                workspace, workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_cublaslt(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                              int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                              bool ue8m0_act_scale, float* out, int64_t out_stride, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  return LtPath(handle, x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, nullptr, out, out_stride,
                workspace, workspace_bytes, stream, refusal);
}

size_t fp8_gemm_quantized_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  return SizesValid(m, n, k) ? fp8_workspace::QuantizedBytes(m, n, k) : 0;
}

cudaError_t fp8_gemm_quantized(const uint8_t* xq, const float* xs, int64_t m, int64_t k,
                               const uint8_t* w, const float* w_scale, int64_t n,
                               __nv_bfloat16* out, int64_t out_stride, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  return QuantizedPath(xq, xs, m, k, w, w_scale, n, out, nullptr, out_stride, workspace,
                       workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_quantized(const uint8_t* xq, const float* xs, int64_t m, int64_t k,
                               const uint8_t* w, const float* w_scale, int64_t n, float* out,
                               int64_t out_stride, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, std::string* refusal) {
  return QuantizedPath(xq, xs, m, k, w, w_scale, n, nullptr, out, out_stride, workspace,
                       workspace_bytes, stream, refusal);
}

}  // namespace pdserve::kernels::cuda
