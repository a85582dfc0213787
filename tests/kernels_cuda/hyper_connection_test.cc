// kernels/cuda/hyper_connection against a host evaluation of engine/hyper_connection.cc (which
// needs the engine's tensors, so its loops are restated here over kernels/cpu RmsNorm, Sigmoid and
// SinkhornProject). The mixing input is computed as the engine computes it: rms(flatten(streams))
// fn^T with random fn, base and scale.
#include "kernels/cuda/hyper_connection.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/activations.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/sinkhorn.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;
using testing::NormalValues;
using testing::Widen;

constexpr float kEps = 1e-6f;  // hc_eps
constexpr float kRmsEps = 1e-6f;
constexpr int64_t kIters = 20;  // hc_sinkhorn_iters
constexpr double kTolerance = 1e-5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::string Describe(int64_t rows, int64_t hc, int64_t hidden) {
  return "rows " + std::to_string(rows) + " hc " + std::to_string(hc) + " hidden " +
         std::to_string(hidden);
}

// One site's inputs: streams [rows, hc, hidden], weights fn [outputs, hc * hidden], base
// [outputs], scale [3], and mix = rms(flatten(streams)) fn^T [rows, outputs].
struct SiteCase {
  int64_t rows;
  int64_t hc;
  int64_t hidden;
  int64_t outputs;
  std::vector<float> streams;
  std::vector<float> base;
  std::vector<float> scale;
  std::vector<float> mix;
};

SiteCase MakeSite(std::mt19937_64& rng, int64_t rows, int64_t hc, int64_t hidden, int64_t outputs) {
  SiteCase c{rows, hc, hidden, outputs, {}, {}, {}, {}};
  const int64_t flat = hc * hidden;
  c.streams = NormalValues(rng, static_cast<size_t>(rows * flat), 0.0f, 1.0f);
  const std::vector<float> fn = NormalValues(rng, static_cast<size_t>(outputs * flat), 0.0f,
                                             1.0f / std::sqrt(static_cast<float>(flat)));
  c.base = NormalValues(rng, static_cast<size_t>(outputs), 0.0f, 0.5f);
  c.scale = NormalValues(rng, 3, 1.0f, 0.5f);
  std::vector<float> normed(c.streams.size());
  cpu::RmsNorm(c.streams.data(), nullptr, rows, flat, kRmsEps, normed.data());
  c.mix.resize(static_cast<size_t>(rows * outputs));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < outputs; ++o) {
      double dot = 0.0;
      for (int64_t i = 0; i < flat; ++i) dot += double{normed[r * flat + i]} * fn[o * flat + i];
      c.mix[r * outputs + o] = static_cast<float>(dot);
    }
  }
  return c;
}

// engine/hyper_connection.cc Collapse.
std::vector<float> CollapseReference(const std::vector<float>& pre, const std::vector<float>& s,
                                     int64_t rows, int64_t hc, int64_t hidden) {
  std::vector<float> out(static_cast<size_t>(rows * hidden), 0.0f);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < hc; ++j) {
      const float p = pre[t * hc + j];
      for (int64_t c = 0; c < hidden; ++c) out[t * hidden + c] += p * s[(t * hc + j) * hidden + c];
    }
  }
  return out;
}

struct PreReference {
  std::vector<float> post;
  std::vector<float> comb;
  std::vector<float> collapsed;
};

// engine/hyper_connection.cc HyperConnectionPre after Mix.
PreReference PreOnCpu(const SiteCase& c) {
  const int64_t hc = c.hc;
  PreReference r;
  std::vector<float> pre(static_cast<size_t>(c.rows * hc));
  r.post.resize(pre.size());
  r.comb.resize(static_cast<size_t>(c.rows * hc * hc));
  for (int64_t t = 0; t < c.rows; ++t) {
    const float* m = c.mix.data() + t * c.outputs;
    for (int64_t j = 0; j < hc; ++j) {
      pre[t * hc + j] = cpu::Sigmoid(m[j] * c.scale[0] + c.base[j]) + kEps;
      r.post[t * hc + j] = 2.0f * cpu::Sigmoid(m[hc + j] * c.scale[1] + c.base[hc + j]);
    }
    float* comb = r.comb.data() + t * hc * hc;
    for (int64_t j = 0; j < hc * hc; ++j) comb[j] = m[2 * hc + j] * c.scale[2] + c.base[2 * hc + j];
    cpu::SinkhornProject(comb, hc, kIters, kEps);
  }
  r.collapsed = CollapseReference(pre, c.streams, c.rows, hc, c.hidden);
  return r;
}

// engine/hyper_connection.cc HyperConnectionPost.
void PostOnCpu(const std::vector<float>& post, const std::vector<float>& comb,
               const std::vector<float>& y, int64_t rows, int64_t hc, int64_t hidden,
               std::vector<float>* streams) {
  std::vector<float> old(static_cast<size_t>(hc * hidden));
  for (int64_t t = 0; t < rows; ++t) {
    float* s = streams->data() + t * hc * hidden;
    std::copy_n(s, hc * hidden, old.data());
    for (int64_t k = 0; k < hc; ++k) {
      float* o = s + k * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] = post[t * hc + k] * y[t * hidden + c];
      for (int64_t j = 0; j < hc; ++j) {
        const float cjk = comb[(t * hc + j) * hc + k];
        for (int64_t c = 0; c < hidden; ++c) o[c] += cjk * old[j * hidden + c];
      }
    }
  }
}

// Device copies of a site's inputs.
struct DeviceSite {
  explicit DeviceSite(const SiteCase& c)
      : mix(c.mix.size()), streams(c.streams.size()), base(c.base.size()), scale(3) {
    mix.Upload(c.mix);
    streams.Upload(c.streams);
    base.Upload(c.base);
    scale.Upload(c.scale);
  }
  bool ok() const { return mix.ok() && streams.ok() && base.ok() && scale.ok(); }
  GuardedBuffer<float> mix, streams, base, scale;
};

// Runs hyper_connection_pre and then hyper_connection_post on the GPU's own post / comb, and
// compares each stage with the CPU (whose post stage starts from the CPU's post / comb).
void ExpectSiteMatchesCpu(std::mt19937_64& rng, const SiteCase& c) {
  const std::string what = Describe(c.rows, c.hc, c.hidden);
  const int64_t hc = c.hc;
  DeviceSite d(c);
  GuardedBuffer<float> post(static_cast<size_t>(c.rows * hc));
  GuardedBuffer<float> comb(static_cast<size_t>(c.rows * hc * hc));
  GuardedBuffer<float> collapsed(static_cast<size_t>(c.rows * c.hidden));
  const std::vector<float> y =
      NormalValues(rng, static_cast<size_t>(c.rows * c.hidden), 0.0f, 1.0f);
  GuardedBuffer<float> d_y(y.size());
  ASSERT_TRUE(d.ok() && post.ok() && comb.ok() && collapsed.ok() && d_y.ok());
  d_y.Upload(y);
  PDSERVE_CUDA_OK(hyper_connection_pre(d.mix.get(), d.streams.get(), c.rows, hc, c.hidden,
                                       d.base.get(), d.scale.get(), kEps, kIters, post.get(),
                                       comb.get(), collapsed.get(), nullptr));
  PDSERVE_CUDA_OK(hyper_connection_post(post.get(), comb.get(), d_y.get(), c.rows, hc, c.hidden,
                                        d.streams.get(), nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got_post = post.Download();
  const std::vector<float> got_comb = comb.Download();
  const std::vector<float> got_collapsed = collapsed.Download();
  const std::vector<float> got_streams = d.streams.Download();
  EXPECT_TRUE(post.GuardsIntact() && comb.GuardsIntact() && collapsed.GuardsIntact() &&
              d.streams.GuardsIntact())
      << what;

  // The reference allocates only after the kernels ran.
  const PreReference want = PreOnCpu(c);
  testing::ExpectNear(Widen(got_post), Widen(want.post), kTolerance, what + " post");
  testing::ExpectNear(Widen(got_comb), Widen(want.comb), kTolerance, what + " comb");
  testing::ExpectNear(Widen(got_collapsed), Widen(want.collapsed), kTolerance, what + " collapsed");
  std::vector<float> want_streams = c.streams;
  PostOnCpu(want.post, want.comb, y, c.rows, hc, c.hidden, &want_streams);
  testing::ExpectNear(Widen(got_streams), Widen(want_streams), kTolerance, what + " streams");
}

TEST(CudaHyperConnectionTest, PreAndPostMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // hidden 37 and 300: partial column chunks; 256: exactly one; 1000: several.
  for (int64_t hc : {1, 2, 3, 4}) {
    for (int64_t hidden : {37, 256, 300, 1000}) {
      for (int64_t rows : {1, 9}) {
        ExpectSiteMatchesCpu(rng, MakeSite(rng, rows, hc, hidden, (2 + hc) * hc));
      }
    }
  }
}

TEST(CudaHyperConnectionTest, LargestHcAndManyRowsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  ExpectSiteMatchesCpu(rng,
                       MakeSite(rng, 3, kMaxSinkhornN, 45, (2 + kMaxSinkhornN) * kMaxSinkhornN));
  ExpectSiteMatchesCpu(rng, MakeSite(rng, 600, 4, 129, 24));
}

// NaN in one stream value of row 1 reaches only that row's collapsed column and new streams of
// that column (mix is finite, as it would be computed before the NaN appeared).
TEST(CudaHyperConnectionTest, NaNStaysInItsRowAndColumn) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  SiteCase c = MakeSite(rng, 4, 4, 37, 24);
  c.streams[(1 * 4 + 2) * 37 + 5] = kNaN;
  ExpectSiteMatchesCpu(rng, c);
}

TEST(CudaHyperConnectionTest, HeadMatchesCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (int64_t hc : {1, 2, 3, 4}) {
    for (int64_t hidden : {37, 256, 1000}) {
      for (int64_t rows : {1, 9}) {
        const SiteCase c = MakeSite(rng, rows, hc, hidden, hc);
        const std::string what = Describe(rows, hc, hidden);
        DeviceSite d(c);
        GuardedBuffer<float> out(static_cast<size_t>(rows * hidden));
        ASSERT_TRUE(d.ok() && out.ok());
        PDSERVE_CUDA_OK(hyper_head(d.mix.get(), d.streams.get(), rows, hc, hidden, d.base.get(),
                                   d.scale.get(), kEps, out.get(), nullptr));
        PDSERVE_CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> got = out.Download();
        EXPECT_TRUE(out.GuardsIntact()) << what;
        EXPECT_EQ(d.streams.Download(), c.streams) << what;

        // engine/hyper_connection.cc HyperHead after Mix.
        std::vector<float> pre(static_cast<size_t>(rows * hc));
        for (int64_t t = 0; t < rows; ++t) {
          for (int64_t j = 0; j < hc; ++j) {
            pre[t * hc + j] = cpu::Sigmoid(c.mix[t * hc + j] * c.scale[0] + c.base[j]) + kEps;
          }
        }
        testing::ExpectNear(Widen(got), Widen(CollapseReference(pre, c.streams, rows, hc, hidden)),
                            kTolerance, what);
      }
    }
  }
}

TEST(CudaHyperConnectionTest, ZeroRowsWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const SiteCase c = MakeSite(rng, 2, 4, 37, 24);
  DeviceSite d(c);
  GuardedBuffer<float> out(64);
  ASSERT_TRUE(d.ok() && out.ok());
  const std::vector<float> init(64, kNaN);
  out.Upload(init);
  float* o = out.get();
  PDSERVE_CUDA_OK(hyper_connection_pre(d.mix.get(), d.streams.get(), 0, 4, 37, d.base.get(),
                                       d.scale.get(), kEps, kIters, o, o, o, nullptr));
  PDSERVE_CUDA_OK(hyper_connection_post(d.mix.get(), d.mix.get(), d.mix.get(), 0, 4, 37,
                                        d.streams.get(), nullptr));
  PDSERVE_CUDA_OK(hyper_connection_post(d.mix.get(), d.mix.get(), d.mix.get(), 2, 4, 0,
                                        d.streams.get(), nullptr));
  PDSERVE_CUDA_OK(hyper_head(d.mix.get(), d.streams.get(), 0, 4, 37, d.base.get(), d.scale.get(),
                             kEps, o, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = out.Download();
  for (float v : got) EXPECT_TRUE(std::isnan(v));
  EXPECT_EQ(d.streams.Download(), c.streams);
  EXPECT_TRUE(out.GuardsIntact() && d.streams.GuardsIntact());
}

TEST(CudaHyperConnectionTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> b(4096);
  ASSERT_TRUE(b.ok());
  float* p = b.get();
  EXPECT_EQ(hyper_connection_pre(p, p, 1, 0, 8, p, p, kEps, kIters, p, p, p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      hyper_connection_pre(p, p, 1, kMaxSinkhornN + 1, 8, p, p, kEps, kIters, p, p, p, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(hyper_connection_pre(p, p, -1, 4, 8, p, p, kEps, kIters, p, p, p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(hyper_connection_pre(p, p, 1, 4, 8, p, nullptr, kEps, kIters, p, p, p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(hyper_connection_post(p, p, p, 1, 4, -8, p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(hyper_connection_post(p, nullptr, p, 1, 4, 8, p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(hyper_head(p, p, 1, 4, int64_t{1} << 61, p, p, kEps, p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(hyper_head(p, p, 1, 4, 8, p, p, kEps, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
