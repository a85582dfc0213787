#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/fp8_gemm.cuh"

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

// Workspace: xq [m, k] e4m3 | xs [k / 128, m] fp32 | partial [splits, m, n] fp32.
struct DensePlan {
  int tiles = 1;
  int64_t items = 0;
  int32_t splits = 1;
  size_t xq_bytes = 0;
  size_t xs_bytes = 0;
  size_t partial_bytes = 0;
  size_t total() const { return xq_bytes + xs_bytes + partial_bytes; }
};

DensePlan PlanDense(int64_t m, int64_t n, int64_t k) {
  DensePlan p;
  p.tiles = bs::TilesFor(m);
  p.items = (m + 8 * p.tiles - 1) / (8 * p.tiles);
  const int64_t row_tiles = (n + bs::kRowsPerBlock - 1) / bs::kRowsPerBlock;
  p.splits = bs::ChooseKSplits(row_tiles * p.items, k / bs::kBlockK);
  p.xq_bytes = bs::AlignUp(static_cast<size_t>(m * k));
  p.xs_bytes = bs::AlignUp(static_cast<size_t>(m * (k / bs::kBlockK)) * sizeof(float));
  p.partial_bytes = p.splits > 1 ? bs::AlignUp(static_cast<size_t>(p.splits) * m * n * 4) : 0;
  return p;
}

bool SizesValid(int64_t m, int64_t n, int64_t k) {
  return m >= 0 && n >= 0 && k > 0 && k % bs::kBlockK == 0 &&
         bs::ProductAtMost(m, k, kMaxElements) && bs::ProductAtMost(n, k, kMaxElements) &&
         bs::ProductAtMost(16 * m, n, kMaxElements);
}

// The GemmArgs of one dense product (each row its own, k split `splits` ways); the caller sets
// the activations (xq / xs quantized, or xb / xb_stride bf16).
bs::GemmArgs DenseArgs(const uint8_t* w, const float* w_scale, int64_t m, int64_t n, int64_t k,
                       int32_t splits, float* partial, __nv_bfloat16* out, int64_t out_stride) {
  bs::GemmArgs a{};
  a.w = w;
  a.w_scale = w_scale;
  a.x_rows = m;
  a.n = n;
  a.k = k;
  a.dense_rows = m;
  a.x_row_div = 1;
  a.k_splits = splits;
  a.partial = partial;
  a.out_rows = m;
  a.out = out;
  a.out_stride = out_stride;
  return a;
}

}  // namespace

size_t fp8_gemm_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  if (!SizesValid(m, n, k)) return 0;
  const size_t mma = PlanDense(m, n, k).total();
  const size_t wgmma = fp8_gemm_wgmma_workspace_bytes(m, n, k, fp8_gemm_wgmma_default_config());
  const size_t lt =
      fp8_gemm_path(m) == Fp8GemmPath::kCublasLt ? fp8_gemm_cublaslt_workspace_bytes(m, k) : 0;
  return std::max({mma, wgmma, lt});
}

Fp8GemmPath fp8_gemm_path(int64_t m) {
  static const std::string forced = [] {
    const char* env = std::getenv("PDSERVE_FP8_GEMM");
    return std::string(env != nullptr ? env : "");
  }();
  if (forced == "mma") return Fp8GemmPath::kMma;
  if (forced == "wgmma") return Fp8GemmPath::kWgmma;
  return m <= kFp8MmaMaxTokens ? Fp8GemmPath::kMma : Fp8GemmPath::kWgmma;
}

Fp8GemmPath fp8_gemm_w8a16_path(int64_t m) {
  const Fp8GemmPath forced = fp8_gemm_path(0);  // kMma unless PDSERVE_FP8_GEMM=wgmma
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

cudaError_t fp8_gemm(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                     __nv_bfloat16* out, int64_t out_stride, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  const Fp8GemmPath path = fp8_gemm_path(m);
  // cuBLASLt is not chosen by fp8_gemm_path any more (see fp8_gemm.cuh); kept for a forced path.
  const bool use_lt = path == Fp8GemmPath::kCublasLt && n % kFp8LtRowBlock == 0 &&
                      out_stride % 8 == 0 &&
                      workspace_bytes >= fp8_gemm_cublaslt_workspace_bytes(m, k);
  const bool wgmma = (path == Fp8GemmPath::kWgmma || (path == Fp8GemmPath::kCublasLt && !use_lt)) &&
                     SizesValid(m, n, k) &&
                     fp8_gemm_wgmma_workspace_bytes(m, n, k, fp8_gemm_wgmma_default_config()) > 0;
  if (wgmma) {
    return fp8_gemm_wgmma(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, out_stride,
                          workspace, workspace_bytes, stream, fp8_gemm_wgmma_default_config(),
                          refusal);
  }
  if (use_lt) {
    const cublasLtHandle_t lt = SharedLtHandle();
    if (lt != nullptr) {
      const cudaError_t status =
          fp8_gemm_cublaslt(lt, x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, out_stride,
                            workspace, workspace_bytes, stream, refusal);
      if (status != cudaErrorNotSupported) return status;
      (void)cudaGetLastError();  // no algorithm for this size: the mma.sync path below
      if (refusal != nullptr) refusal->clear();
    }
  }
  return fp8_gemm_mma(x, m, k, x_stride, w, w_scale, n, ue8m0_act_scale, out, out_stride, workspace,
                      workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                         const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                         __nv_bfloat16* out, int64_t out_stride, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  cudaError_t status = ValidateDense(x, m, k, x_stride, w, w_scale, n, out, out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  const DensePlan plan = PlanDense(m, n, k);
  status = CheckWorkspace(workspace, workspace_bytes, plan.total(), refusal);
  if (status != cudaSuccess) return status;
  uint8_t* base = static_cast<uint8_t*>(workspace);
  uint8_t* xq = base;
  float* xs = reinterpret_cast<float*>(base + plan.xq_bytes);
  float* partial = reinterpret_cast<float*>(base + plan.xq_bytes + plan.xs_bytes);
  status = bs::LaunchActQuant(x, m, k, x_stride, ue8m0_act_scale, xq, xs, stream);
  if (status != cudaSuccess) return status;
  bs::GemmArgs a = DenseArgs(w, w_scale, m, n, k, plan.splits, partial, out, out_stride);
  a.xq = xq;
  a.xs = xs;
  status = bs::LaunchGemm<false>(a, plan.tiles, plan.items, stream);
  if (status != cudaSuccess || plan.splits == 1) return status;
  return bs::LaunchReduce(partial, plan.splits, m, n, nullptr, nullptr, 0, out, out_stride, stream);
}

size_t fp8_gemm_w8a16_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  if (!SizesValid(m, n, k)) return 0;
  return std::max(PlanDense(m, n, k).partial_bytes,
                  fp8_gemm_w8a16_wgmma_workspace_bytes(m, n, k, fp8_gemm_wgmma_default_config()));
}

cudaError_t fp8_gemm_w8a16(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                           int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, std::string* refusal) {
  if (fp8_gemm_w8a16_path(m) == Fp8GemmPath::kWgmma && SizesValid(m, n, k)) {
    return fp8_gemm_w8a16_wgmma(x, m, k, x_stride, w, w_scale, n, out, out_stride, workspace,
                                workspace_bytes, stream, fp8_gemm_wgmma_default_config(), refusal);
  }
  return fp8_gemm_w8a16_mma(x, m, k, x_stride, w, w_scale, n, out, out_stride, workspace,
                            workspace_bytes, stream, refusal);
}

cudaError_t fp8_gemm_w8a16_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                               const uint8_t* w, const float* w_scale, int64_t n,
                               __nv_bfloat16* out, int64_t out_stride, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, std::string* refusal) {
  cudaError_t status = ValidateDense(x, m, k, x_stride, w, w_scale, n, out, out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  const DensePlan plan = PlanDense(m, n, k);
  if (plan.splits > 1) {
    status = CheckWorkspace(workspace, workspace_bytes, plan.partial_bytes, refusal);
    if (status != cudaSuccess) return status;
  }
  float* partial = static_cast<float*>(workspace);
  bs::GemmArgs a = DenseArgs(w, w_scale, m, n, k, plan.splits, partial, out, out_stride);
  a.xb = x;
  a.xb_stride = x_stride;
  status = bs::LaunchGemm<false, true>(a, plan.tiles, plan.items, stream);
  if (status != cudaSuccess || plan.splits == 1) return status;
  return bs::LaunchReduce(partial, plan.splits, m, n, nullptr, nullptr, 0, out, out_stride, stream);
}

// ---------------------------------------------------------------------------------------------
// cuBLASLt. Column-major view: out^T [n, m] = W^T' [n, k] x xq^T [k, m], i.e. A = w stored as a
// column-major [k, n] matrix with op T, B = xq stored column-major [k, m] with op N (the "TN"
// layout FP8 requires). A's scales: BLK128x128 over [n/128, k/128] with k fastest (DeepSeek's
// layout); B's: VEC128 [k/128, m] with m fastest (what the act-quant kernel writes).

size_t fp8_gemm_cublaslt_workspace_bytes(int64_t m, int64_t k) {
  if (!SizesValid(m, 0, k)) return 0;
  return bs::AlignUp(static_cast<size_t>(m * k)) +
         bs::AlignUp(static_cast<size_t>(m * (k / bs::kBlockK)) * sizeof(float)) +
         kCublasLtWorkspace;
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
                     int64_t k, const uint8_t* w, const float* w_scale, int64_t n,
                     __nv_bfloat16* out, int64_t out_stride, void* lt_workspace,
                     cudaStream_t stream, std::string* refusal) {
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
  PDSERVE_LT("layout d", cublasLtMatrixLayoutCreate(&desc.d, CUDA_R_16BF, n, m, out_stride));
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

}  // namespace

cudaError_t fp8_gemm_cublaslt(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                              int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                              bool ue8m0_act_scale, __nv_bfloat16* out, int64_t out_stride,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream,
                              std::string* refusal) {
  cudaError_t status = ValidateDense(x, m, k, x_stride, w, w_scale, n, out, out_stride, refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  if (n % 16 != 0)
    return bs::Refuse(refusal, "n: not a multiple of 16 (" + std::to_string(n) + ")");
  if (out_stride % 8 != 0) return bs::Refuse(refusal, "out_stride: not a multiple of 8");
  if (handle == nullptr) return bs::Refuse(refusal, "handle: null");
  status =
      CheckWorkspace(workspace, workspace_bytes, fp8_gemm_cublaslt_workspace_bytes(m, k), refusal);
  if (status != cudaSuccess) return status;
  uint8_t* base = static_cast<uint8_t*>(workspace);
  const size_t xq_bytes = bs::AlignUp(static_cast<size_t>(m * k));
  const size_t xs_bytes = bs::AlignUp(static_cast<size_t>(m * (k / bs::kBlockK)) * sizeof(float));
  float* xs = reinterpret_cast<float*>(base + xq_bytes);
  status = bs::LaunchActQuant(x, m, k, x_stride, ue8m0_act_scale, base, xs, stream);
  if (status != cudaSuccess) return status;
  return LtMatmul(handle, base, xs, m, k, w, w_scale, n, out, out_stride,
                  base + xq_bytes + xs_bytes, stream, refusal);
}

}  // namespace pdserve::kernels::cuda
