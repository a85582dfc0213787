// kernels/cuda/moe against host replicas of engine/moe.cc (Moe::Route after the gate GEMM, and the
// routed part of Moe::Forward), built from the CPU kernels (kernels/cpu softmax, activations,
// topk) on the same bf16-rounded inputs.
#include "kernels/cuda/moe.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/activations.h"
#include "kernels/cpu/softmax.h"
#include "kernels/cpu/topk.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FromBf16;
using testing::GuardedBuffer;
using testing::ToBf16;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kRoutedScale = 1.5f;

const MoeScoring kScorings[] = {MoeScoring::kSoftmax, MoeScoring::kSigmoid,
                                MoeScoring::kSqrtSoftplus};

std::string Name(MoeScoring s) {
  return s == MoeScoring::kSoftmax ? "softmax" : s == MoeScoring::kSigmoid ? "sigmoid" : "sqrtsp";
}

__nv_bfloat16* Bf16(GuardedBuffer<uint16_t>& b) {
  return reinterpret_cast<__nv_bfloat16*>(b.get());
}

struct Routing {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};

// The inputs of moe_route. bias / tid2eid empty = nullptr.
struct RouteProblem {
  int64_t rows = 0;
  int64_t n_experts = 0;
  int64_t k = 0;
  MoeScoring scoring = MoeScoring::kSoftmax;
  std::vector<float> logits;
  std::vector<float> bias;
  std::vector<int32_t> tid2eid;
  std::vector<int32_t> tokens;
};

// Moe::Route from the logits on: scores, hash or top-k pick, normalized weights. Hash ids outside
// [0, n_experts) (and negative tokens) get weight 0 and stay out of the sum, as moe_route
// documents; the CPU model never has them.
Routing ReferenceRoute(const RouteProblem& p) {
  Routing out;
  out.experts.resize(static_cast<size_t>(p.rows * p.k));
  out.weights.resize(out.experts.size());
  std::vector<float> s(static_cast<size_t>(p.n_experts));
  std::vector<float> biased(s.size());
  std::vector<int32_t> scratch(s.size());
  for (int64_t r = 0; r < p.rows; ++r) {
    std::copy_n(p.logits.begin() + r * p.n_experts, p.n_experts, s.begin());
    for (float& v : s) {
      if (p.scoring == MoeScoring::kSigmoid) v = cpu::Sigmoid(v);
      if (p.scoring == MoeScoring::kSqrtSoftplus) v = cpu::SqrtSoftplus(v);
    }
    if (p.scoring == MoeScoring::kSoftmax) cpu::Softmax(s.data(), p.n_experts);
    int32_t* picked = out.experts.data() + r * p.k;
    if (!p.tid2eid.empty()) {
      const int32_t token = p.tokens[static_cast<size_t>(r)];
      for (int64_t j = 0; j < p.k; ++j) picked[j] = token < 0 ? -1 : p.tid2eid[token * p.k + j];
    } else {
      for (int64_t e = 0; e < p.n_experts; ++e) {
        biased[e] = s[e] + (p.bias.empty() ? 0.0f : p.bias[e]);
      }
      cpu::TopK(biased.data(), p.n_experts, p.k, picked, scratch.data());
    }
    auto valid = [&](int32_t e) { return e >= 0 && e < p.n_experts; };
    float sum = 0.0f;
    for (int64_t j = 0; j < p.k; ++j) sum += valid(picked[j]) ? s[picked[j]] : 0.0f;
    const float norm = kRoutedScale / (sum + 1e-20f);
    for (int64_t j = 0; j < p.k; ++j) {
      out.weights[r * p.k + j] = valid(picked[j]) ? s[picked[j]] * norm : 0.0f;
    }
  }
  return out;
}

// Same experts; weights within 1e-6 relative.
void ExpectSameRouting(const Routing& got, const Routing& want, const std::string& what) {
  EXPECT_EQ(got.experts, want.experts) << what;
  ASSERT_EQ(got.weights.size(), want.weights.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < want.weights.size(); ++i) {
    if (!(std::abs(got.weights[i] - want.weights[i]) <= 1e-6f * std::abs(want.weights[i]))) {
      if (bad++ < 3)
        ADD_FAILURE() << what << " weight " << i << ": " << got.weights[i] << " vs "
                      << want.weights[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// The inputs of moe_experts (bf16 as bit patterns) and the output's initial value.
struct ExpertProblem {
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t k = 0;
  int64_t n_experts = 0;
  float limit = 10.0f;
  std::vector<uint16_t> x;
  std::vector<uint16_t> gate_up;
  std::vector<uint16_t> down;
  std::vector<int32_t> experts;
  std::vector<float> weights;
  std::vector<float> out_init;
};

std::string Describe(const ExpertProblem& p) {
  return "rows " + std::to_string(p.rows) + " hidden " + std::to_string(p.hidden) + " inter " +
         std::to_string(p.inter) + " k " + std::to_string(p.k) + " experts " +
         std::to_string(p.n_experts) + " limit " + std::to_string(p.limit);
}

// The routed part of Moe::Forward: for each expert in ascending order, for its picks in pick
// order, out[r] += w * down_e(ClampedSwiGlu(gate_e x_r, up_e x_r)). Dot products in fp64 over
// the bf16 values, the activation in fp32 (cpu::ClampedSwiGlu). Invalid ids are skipped.
std::vector<double> ReferenceExperts(const ExpertProblem& p) {
  std::vector<double> out(p.out_init.begin(), p.out_init.end());
  std::vector<float> gate(static_cast<size_t>(p.inter));
  std::vector<float> up(gate.size());
  std::vector<float> act(gate.size());
  for (int64_t e = 0; e < p.n_experts; ++e) {
    const uint16_t* w_gate = p.gate_up.data() + e * 2 * p.inter * p.hidden;
    const uint16_t* w_down = p.down.data() + e * p.hidden * p.inter;
    for (int64_t a = 0; a < p.rows * p.k; ++a) {
      if (p.experts[a] != e) continue;
      const int64_t r = a / p.k;
      const uint16_t* x = p.x.data() + r * p.hidden;
      for (int64_t i = 0; i < p.inter; ++i) {
        double g = 0.0;
        double u = 0.0;
        for (int64_t h = 0; h < p.hidden; ++h) {
          const double xv = FromBf16(x[h]);
          g += xv * FromBf16(w_gate[i * p.hidden + h]);
          u += xv * FromBf16(w_gate[(p.inter + i) * p.hidden + h]);
        }
        gate[i] = static_cast<float>(g);
        up[i] = static_cast<float>(u);
      }
      cpu::ClampedSwiGlu(gate.data(), up.data(), p.inter, p.limit, act.data());
      for (int64_t c = 0; c < p.hidden; ++c) {
        double y = 0.0;
        for (int64_t i = 0; i < p.inter; ++i) y += act[i] * FromBf16(w_down[c * p.inter + i]);
        out[r * p.hidden + c] += p.weights[a] * y;
      }
    }
  }
  return out;
}

// moe_experts' device buffers, filled from a problem (out from out_init), and its call.
struct DeviceExperts {
  explicit DeviceExperts(const ExpertProblem& p)
      : x(p.x.size()),
        gate_up(p.gate_up.size()),
        down(p.down.size()),
        experts(p.experts.size()),
        weights(p.weights.size()),
        out(p.out_init.size()),
        workspace_bytes(moe_experts_workspace_bytes(p.rows, p.k, p.inter)),
        workspace(workspace_bytes) {
    x.Upload(p.x);
    gate_up.Upload(p.gate_up);
    down.Upload(p.down);
    experts.Upload(p.experts);
    weights.Upload(p.weights);
    out.Upload(p.out_init);
  }

  bool ok() const {
    return x.ok() && gate_up.ok() && down.ok() && experts.ok() && weights.ok() && out.ok() &&
           workspace.ok();
  }

  cudaError_t Run(const ExpertProblem& p, cudaStream_t stream) {
    return moe_experts(Bf16(x), p.rows, p.hidden, p.inter, p.k, p.n_experts, Bf16(gate_up),
                       Bf16(down), experts.get(), weights.get(), p.limit, workspace.get(),
                       workspace_bytes, out.get(), stream);
  }

  GuardedBuffer<uint16_t> x;
  GuardedBuffer<uint16_t> gate_up;
  GuardedBuffer<uint16_t> down;
  GuardedBuffer<int32_t> experts;
  GuardedBuffer<float> weights;
  GuardedBuffer<float> out;
  size_t workspace_bytes;
  GuardedBuffer<unsigned char> workspace;
};

class CudaMoeTest : public ::testing::Test {
 protected:
  std::vector<uint16_t> RandomBf16(size_t n, float stddev) {
    std::normal_distribution<float> normal(0.0f, stddev);
    std::vector<uint16_t> v(n);
    for (uint16_t& b : v) b = ToBf16(normal(rng_));
    return v;
  }

  // Random inputs; each row picks k distinct experts with weights in [0.1, 2). When k <
  // n_experts one expert is never picked and its weights are NaN (they must not leak).
  ExpertProblem MakeExperts(int64_t rows, int64_t hidden, int64_t inter, int64_t k,
                            int64_t n_experts, float limit) {
    ExpertProblem p{rows, hidden, inter, k, n_experts, limit, {}, {}, {}, {}, {}, {}};
    p.x = RandomBf16(static_cast<size_t>(rows * hidden), 1.0f);
    p.gate_up = RandomBf16(static_cast<size_t>(n_experts * 2 * inter * hidden),
                           1.0f / std::sqrt(static_cast<float>(hidden)));
    p.down = RandomBf16(static_cast<size_t>(n_experts * hidden * inter),
                        1.0f / std::sqrt(static_cast<float>(inter)));
    std::vector<int32_t> ids(static_cast<size_t>(n_experts));
    std::iota(ids.begin(), ids.end(), 0);
    if (k < n_experts) {
      const int32_t unused =
          std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(n_experts - 1))(rng_);
      std::fill_n(p.gate_up.begin() + unused * 2 * inter * hidden, 2 * inter * hidden,
                  testing::kBf16NaN);
      std::fill_n(p.down.begin() + unused * hidden * inter, hidden * inter, testing::kBf16NaN);
      ids.erase(ids.begin() + unused);
    }
    std::uniform_real_distribution<float> weight(0.1f, 2.0f);
    for (int64_t r = 0; r < rows; ++r) {
      std::shuffle(ids.begin(), ids.end(), rng_);
      for (int64_t j = 0; j < k; ++j) {
        p.experts.push_back(ids[j]);
        p.weights.push_back(weight(rng_));
      }
    }
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < rows * hidden; ++i) p.out_init.push_back(normal(rng_));
    return p;
  }

  Routing RunRoute(const RouteProblem& p) {
    GuardedBuffer<float> logits(p.logits.size());
    GuardedBuffer<float> bias(p.bias.size());
    GuardedBuffer<int32_t> tid2eid(p.tid2eid.size());
    GuardedBuffer<int32_t> tokens(p.tokens.size());
    GuardedBuffer<int32_t> experts(static_cast<size_t>(p.rows * p.k));
    GuardedBuffer<float> weights(experts.size());
    EXPECT_TRUE(logits.ok() && bias.ok() && tid2eid.ok() && tokens.ok() && experts.ok() &&
                weights.ok());
    logits.Upload(p.logits);
    bias.Upload(p.bias);
    tid2eid.Upload(p.tid2eid);
    tokens.Upload(p.tokens);
    const cudaError_t status = moe_route(logits.get(), p.rows, p.n_experts, p.k, p.scoring,
                                         p.bias.empty() ? nullptr : bias.get(),
                                         p.tid2eid.empty() ? nullptr : tid2eid.get(), tokens.get(),
                                         kRoutedScale, experts.get(), weights.get(), nullptr);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(experts.GuardsIntact() && weights.GuardsIntact());
    return {experts.Download(), weights.Download()};
  }

  void ExpectRouteMatchesCpu(const RouteProblem& p, const std::string& what) {
    const Routing got = RunRoute(p);  // before the reference allocates
    ExpectSameRouting(got, ReferenceRoute(p), what);
  }

  // Runs moe_experts twice from out_init (the results must be bit-identical) on a workspace
  // pre-filled with 0xFF; checks every guard; returns out.
  std::vector<float> RunExperts(const ExpertProblem& p) {
    DeviceExperts device(p);
    EXPECT_TRUE(device.ok());
    std::vector<float> results[2];
    for (std::vector<float>& result : results) {
      device.out.Upload(p.out_init);
      EXPECT_EQ(cudaMemset(device.workspace.get(), 0xFF, device.workspace_bytes), cudaSuccess);
      const cudaError_t status = device.Run(p, nullptr);
      EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      result = device.out.Download();
    }
    EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4), 0)
        << "not deterministic: " << Describe(p);
    EXPECT_TRUE(device.out.GuardsIntact() && device.workspace.GuardsIntact()) << Describe(p);
    return results[0];
  }

  // The routed contribution (out - out_init) against the reference's by normalized error.
  void ExpectExpertsMatchCpu(const ExpertProblem& p, const std::vector<float>& got) {
    const std::vector<double> want = ReferenceExperts(p);
    std::vector<double> got_delta(got.size());
    std::vector<double> want_delta(got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      got_delta[i] = static_cast<double>(got[i]) - p.out_init[i];
      want_delta[i] = want[i] - p.out_init[i];
    }
    testing::ExpectNear(got_delta, want_delta, 1e-3, Describe(p));
  }

  std::mt19937_64 rng_ = testing::FreshRng();
};

RouteProblem MakeRoute(int64_t rows, int64_t n_experts, int64_t k, MoeScoring scoring) {
  RouteProblem p;
  p.rows = rows;
  p.n_experts = n_experts;
  p.k = k;
  p.scoring = scoring;
  return p;
}

TEST_F(CudaMoeTest, RouteMatchesCpuForEveryScoring) {
  PDSERVE_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t rows, n_experts, k;
    float logit_scale;  // 8: softplus's linear branch (> 20) and saturated sigmoids
  };
  for (const Case& c : std::vector<Case>{{0, 8, 2, 2.0f},
                                         {1, 4, 1, 2.0f},
                                         {7, 16, 6, 2.0f},
                                         {130, 64, 6, 2.0f},
                                         {130, 4, 4, 8.0f},
                                         {33, 256, 6, 8.0f},
                                         {5, 1024, 32, 2.0f}}) {
    for (MoeScoring scoring : kScorings) {
      RouteProblem p = MakeRoute(c.rows, c.n_experts, c.k, scoring);
      std::normal_distribution<float> normal;
      for (int64_t i = 0; i < c.rows * c.n_experts; ++i)
        p.logits.push_back(c.logit_scale * normal(rng_));
      // Row 0 all -inf: softmax's all-zero row, sigmoid and softplus at 0.
      if (c.rows > 1) std::fill_n(p.logits.begin(), c.n_experts, -kInf);
      for (int64_t e = 0; e < c.n_experts; ++e) p.bias.push_back(0.3f * normal(rng_));
      ExpectRouteMatchesCpu(p, Name(scoring) + " rows " + std::to_string(c.rows) + " experts " +
                                   std::to_string(c.n_experts) + " k " + std::to_string(c.k));
    }
  }
}

TEST_F(CudaMoeTest, RouteBreaksTiesByLowerIndex) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::uniform_int_distribution<int> level(-1, 1);
  for (int64_t n_experts : {4, 16, 64}) {
    for (int64_t k = 1; k <= std::min<int64_t>(6, n_experts); ++k) {
      for (MoeScoring scoring : kScorings) {
        for (bool constant_bias : {false, true}) {
          RouteProblem p = MakeRoute(130, n_experts, k, scoring);
          // Logits from three levels: most picks are ties. Row 0: all equal.
          for (int64_t i = 0; i < p.rows * n_experts; ++i) {
            p.logits.push_back(i < n_experts ? 0.5f : static_cast<float>(level(rng_)));
          }
          if (constant_bias) p.bias.assign(static_cast<size_t>(n_experts), 0.25f);
          const std::string what = Name(scoring) + " experts " + std::to_string(n_experts) + " k " +
                                   std::to_string(k) + (constant_bias ? " bias" : "");
          const Routing got = RunRoute(p);
          const Routing want = ReferenceRoute(p);
          for (int64_t j = 0; j < k; ++j) EXPECT_EQ(want.experts[j], j) << what;
          ExpectSameRouting(got, want, what);
        }
      }
    }
  }
}

TEST_F(CudaMoeTest, HashRoutingReadsTid2eidAndZeroesInvalidIds) {
  PDSERVE_SKIP_WITHOUT_GPU();
  constexpr int64_t kVocab = 50;
  constexpr int64_t kExperts = 16;
  for (int64_t k : {1, 3, 6}) {
    for (MoeScoring scoring : kScorings) {
      RouteProblem p = MakeRoute(130, kExperts, k, scoring);
      std::normal_distribution<float> normal;
      for (int64_t i = 0; i < p.rows * kExperts; ++i) p.logits.push_back(2.0f * normal(rng_));
      std::uniform_int_distribution<int32_t> expert(0, kExperts - 1);
      for (int64_t i = 0; i < kVocab * k; ++i) p.tid2eid.push_back(expert(rng_));
      p.tid2eid[5 * k] = -1;
      p.tid2eid[6 * k + k - 1] = kExperts;
      p.tid2eid[7 * k] = std::numeric_limits<int32_t>::max();
      std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
      for (int64_t r = 0; r < p.rows; ++r) p.tokens.push_back(token(rng_));
      p.tokens[0] = 5;
      p.tokens[1] = 6;
      p.tokens[2] = 7;
      p.tokens[3] = -3;
      // A NaN bias: hash layers must ignore it.
      p.bias.assign(static_cast<size_t>(kExperts), kNaN);
      const Routing got = RunRoute(p);
      EXPECT_EQ(got.weights[0], 0.0f);
      EXPECT_EQ(got.experts[3 * k], -1);
      ExpectSameRouting(got, ReferenceRoute(p), Name(scoring) + " hash k " + std::to_string(k));
    }
  }
}

TEST_F(CudaMoeTest, ExpertsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t rows, hidden, inter, k, n_experts;
    float limit;  // 0.5 clamps most gates and ups
  };
  // 16-byte and scalar loads for each product (hidden, inter % 8), one tile per expert and many,
  // one chunk of output columns (max(inter, 512)) and several with a tail.
  for (const Case& c : std::vector<Case>{{1, 48, 72, 1, 4, 10.0f},
                                         {7, 100, 48, 6, 16, 0.5f},
                                         {130, 72, 100, 6, 64, 10.0f},
                                         {130, 48, 72, 3, 4, 0.5f},
                                         {130, 256, 256, 2, 8, 10.0f},
                                         {7, 100, 100, 5, 9, 10.0f},
                                         {3, 1024, 512, 6, 16, 10.0f},
                                         {7, 1100, 100, 4, 8, 10.0f}}) {
    const ExpertProblem p = MakeExperts(c.rows, c.hidden, c.inter, c.k, c.n_experts, c.limit);
    const std::vector<float> got = RunExperts(p);
    ExpectExpertsMatchCpu(p, got);
  }
}

TEST_F(CudaMoeTest, ExpertsAddRepeatedPicksAndSkipInvalidIds) {
  PDSERVE_SKIP_WITHOUT_GPU();
  ExpertProblem p = MakeExperts(130, 72, 48, 6, 8, 10.0f);
  std::uniform_int_distribution<int32_t> expert(0, 7);
  const int32_t invalid[] = {-1, 8, std::numeric_limits<int32_t>::max(),
                             std::numeric_limits<int32_t>::min()};
  for (int64_t a = 0; a < p.rows * p.k; ++a) {
    p.experts[a] = a % 7 == 3 ? invalid[a % 4] : expert(rng_);
  }
  // Expert 2 twice per row (once in row 0), so its repeated picks straddle tile boundaries.
  for (int64_t r = 0; r < p.rows; ++r) {
    p.experts[r * p.k] = 2;
    if (r > 0) p.experts[r * p.k + 1] = 2;
  }
  std::fill_n(p.experts.begin() + 5 * p.k, p.k, -1);  // row 5 picks nothing valid
  std::fill_n(p.experts.begin() + 9 * p.k, p.k, 6);   // row 9 picks expert 6 k times
  const std::vector<float> got = RunExperts(p);
  ExpectExpertsMatchCpu(p, got);
  for (int64_t c = 0; c < p.hidden; ++c) {
    EXPECT_EQ(got[5 * p.hidden + c], p.out_init[5 * p.hidden + c]) << "column " << c;
  }
}

TEST_F(CudaMoeTest, ZeroRowsHiddenOrInterAddNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(64);
  GuardedBuffer<uint16_t> weights_bf16(64);
  GuardedBuffer<int32_t> experts(4);
  GuardedBuffer<float> weights(4);
  GuardedBuffer<float> out(8);
  GuardedBuffer<unsigned char> workspace(64);
  ASSERT_TRUE(x.ok() && weights_bf16.ok() && experts.ok() && weights.ok() && out.ok() &&
              workspace.ok());
  const std::vector<float> init(8, 2.0f);
  out.Upload(init);
  auto call = [&](int64_t rows, int64_t hidden, int64_t inter) {
    return moe_experts(Bf16(x), rows, hidden, inter, 2, 4, Bf16(weights_bf16), Bf16(weights_bf16),
                       experts.get(), weights.get(), 10.0f, workspace.get(), 0, out.get(), nullptr);
  };
  PDSERVE_CUDA_OK(call(0, 4, 4));
  PDSERVE_CUDA_OK(call(2, 0, 4));
  PDSERVE_CUDA_OK(call(2, 4, 0));
  GuardedBuffer<int32_t> route_experts(0);
  GuardedBuffer<float> route_weights(0);
  PDSERVE_CUDA_OK(moe_route(weights.get(), 0, 4, 2, MoeScoring::kSigmoid, nullptr, nullptr, nullptr,
                            1.0f, route_experts.get(), route_weights.get(), nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(out.Download(), init);
  EXPECT_TRUE(out.GuardsIntact() && workspace.GuardsIntact() && route_experts.GuardsIntact() &&
              route_weights.GuardsIntact());
}

// Routing and experts captured once; a replay must read the current logits (new experts).
TEST_F(CudaMoeTest, GraphReplayRoutesFromDeviceMemory) {
  PDSERVE_SKIP_WITHOUT_GPU();
  ExpertProblem p = MakeExperts(7, 64, 48, 6, 16, 10.0f);
  RouteProblem route = MakeRoute(p.rows, p.n_experts, p.k, MoeScoring::kSqrtSoftplus);
  std::normal_distribution<float> normal;
  for (int64_t e = 0; e < p.n_experts; ++e) route.bias.push_back(0.3f * normal(rng_));
  // Every expert's weights finite: the replays pick whichever experts the logits say.
  p.gate_up = RandomBf16(p.gate_up.size(), 0.125f);
  p.down = RandomBf16(p.down.size(), 0.125f);
  DeviceExperts device(p);
  GuardedBuffer<float> logits(static_cast<size_t>(p.rows * p.n_experts));
  GuardedBuffer<float> bias(route.bias.size());
  ASSERT_TRUE(device.ok() && logits.ok() && bias.ok());
  bias.Upload(route.bias);

  cudaStream_t stream = nullptr;
  PDSERVE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  PDSERVE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t routed =
      moe_route(logits.get(), p.rows, p.n_experts, p.k, route.scoring, bias.get(), nullptr, nullptr,
                kRoutedScale, device.experts.get(), device.weights.get(), stream);
  const cudaError_t added = device.Run(p, stream);
  PDSERVE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  PDSERVE_CUDA_OK(routed);
  PDSERVE_CUDA_OK(added);
  cudaGraphExec_t exec = nullptr;
  PDSERVE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    route.logits.clear();
    for (size_t i = 0; i < logits.size(); ++i) route.logits.push_back(2.0f * normal(rng_));
    logits.Upload(route.logits);
    device.out.Upload(p.out_init);
    PDSERVE_CUDA_OK(cudaGraphLaunch(exec, stream));
    PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
    const Routing got_route{device.experts.Download(), device.weights.Download()};
    const std::vector<float> got = device.out.Download();
    const Routing want_route = ReferenceRoute(route);
    ExpectSameRouting(got_route, want_route, "replay " + std::to_string(replay));
    p.experts = want_route.experts;
    p.weights = want_route.weights;
    ExpectExpertsMatchCpu(p, got);
  }
  EXPECT_TRUE(device.out.GuardsIntact() && device.workspace.GuardsIntact() &&
              device.experts.GuardsIntact() && device.weights.GuardsIntact());
  PDSERVE_CUDA_OK(cudaGraphExecDestroy(exec));
  PDSERVE_CUDA_OK(cudaGraphDestroy(graph));
  PDSERVE_CUDA_OK(cudaStreamDestroy(stream));
}

TEST_F(CudaMoeTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> logits(64);
  GuardedBuffer<int32_t> ids(64);
  GuardedBuffer<float> weights(64);
  auto route = [&](int64_t n_experts, int64_t k, const int32_t* tid2eid, const int32_t* tokens) {
    return moe_route(logits.get(), 2, n_experts, k, MoeScoring::kSoftmax, nullptr, tid2eid, tokens,
                     1.0f, ids.get(), weights.get(), nullptr);
  };
  EXPECT_EQ(route(0, 1, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(route(4, 0, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(route(4, 5, nullptr, nullptr), cudaErrorInvalidValue);  // top-k > experts
  EXPECT_EQ(route(kMaxMoeExperts + 1, 2, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(route(4, kMaxMoeTopK + 1, ids.get(), ids.get()), cudaErrorInvalidValue);
  EXPECT_EQ(route(4, 2, ids.get(), nullptr), cudaErrorInvalidValue);  // hash without tokens
  EXPECT_EQ(moe_route(nullptr, 2, 4, 2, MoeScoring::kSigmoid, nullptr, nullptr, nullptr, 1.0f,
                      ids.get(), weights.get(), nullptr),
            cudaErrorInvalidValue);

  GuardedBuffer<uint16_t> bf16(64);
  GuardedBuffer<float> out(64);
  const size_t bytes = moe_experts_workspace_bytes(2, 2, 8);
  GuardedBuffer<unsigned char> workspace(bytes + 16);
  auto experts = [&](int64_t k, int64_t n_experts, unsigned char* ws, size_t ws_bytes, float* dst) {
    return moe_experts(Bf16(bf16), 2, 4, 8, k, n_experts, Bf16(bf16), Bf16(bf16), ids.get(),
                       weights.get(), 10.0f, ws, ws_bytes, dst, nullptr);
  };
  EXPECT_EQ(experts(0, 4, workspace.get(), bytes, out.get()), cudaErrorInvalidValue);
  EXPECT_EQ(experts(2, 0, workspace.get(), bytes, out.get()), cudaErrorInvalidValue);
  EXPECT_EQ(experts(2, kMaxMoeExperts + 1, workspace.get(), bytes, out.get()),
            cudaErrorInvalidValue);
  EXPECT_EQ(experts(2, 4, workspace.get(), bytes - 1, out.get()), cudaErrorInvalidValue);
  EXPECT_EQ(experts(2, 4, workspace.get() + 4, bytes, out.get()), cudaErrorInvalidValue);
  EXPECT_EQ(experts(2, 4, nullptr, bytes, out.get()), cudaErrorInvalidValue);
  EXPECT_EQ(experts(2, 4, workspace.get(), bytes, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(moe_experts_workspace_bytes(-1, 2, 8), 0u);
  EXPECT_EQ(moe_experts_workspace_bytes(2, 0, 8), 0u);
  EXPECT_GE(moe_experts_workspace_bytes(3, 2, 8), 3u * 2u * 8u * sizeof(float));
}

}  // namespace
}  // namespace pdserve::kernels::cuda
