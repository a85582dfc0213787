// The GPU sampler (runtime/cuda/gpu_sampler.h over kernels/cuda/sampling.cuh) against the CPU
// sampler (serving::SampleToken) on the same fresh random logits: every combination of
// temperature {0, 0.6, 1, 1.5}, top_k {0, 1, 50}, top_p {1, 0.9, 0.5}, min_p {0, 0.1},
// penalties, logit_bias, min_tokens and an allowed-token mask (each on / off), and logprobs
// {absent, 0, 5, 20}; at vocab 1000 every combination, at vocab 129,280 every combination of the
// others with the logprobs setting rotating. Rows run in batches of 1, 7 and 64 (in turn), with
// -inf entries, tied logits (the maximum repeated, +0.0 / -0.0) and peaked or flat rows. Counts
// and prints token, logprob and top-logprob mismatches and asserts there are none (tokens equal,
// logprobs within 1e-4). Seeds are fresh each run and printed. Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cuda/sampling.cuh"
#include "kernels/cuda/sampling_workspace.h"
#include "runtime/cuda/gpu_sampler.h"
#include "serving/sampler.h"
#include "serving/sampling_params.h"
#include "serving/token_history.h"

namespace pdserve::runtime {
namespace {

static_assert(kernels::cuda::kGreedyTemperatureDevice == serving::kGreedyTemperature);
static_assert(kernels::cuda::kMaxSampleTopLogprobs == serving::kMaxTopLogprobs);

bool HasGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// One point of the parameter grid.
struct Combo {
  double temperature = 0.0;
  int32_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  bool penalties = false;
  bool bias = false;
  bool min_tokens = false;
  bool mask = false;
  int32_t logprobs = -1;  // -1: absent
};

std::vector<Combo> Grid(bool rotate_logprobs) {
  const double temperatures[] = {0.0, 0.6, 1.0, 1.5};
  const int32_t top_ks[] = {0, 1, 50};
  const double top_ps[] = {1.0, 0.9, 0.5};
  const double min_ps[] = {0.0, 0.1};
  const int32_t logprobs[] = {-1, 0, 5, 20};
  std::vector<Combo> grid;
  for (double t : temperatures) {
    for (int32_t k : top_ks) {
      for (double p : top_ps) {
        for (double m : min_ps) {
          for (int flags = 0; flags < 16; ++flags) {
            Combo c{
                t, k, p, m, (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0, (flags & 8) != 0};
            if (rotate_logprobs) {
              c.logprobs = logprobs[grid.size() % 4];
              grid.push_back(c);
              continue;
            }
            for (int32_t lp : logprobs) {
              c.logprobs = lp;
              grid.push_back(c);
            }
          }
        }
      }
    }
  }
  return grid;
}

// A row's inputs: logits and everything SampleToken takes besides them.
struct Case {
  Combo combo;
  std::vector<float> logits;
  serving::SamplingParams params;
  std::vector<int32_t> end_ids;
  serving::TokenHistory history{std::vector<int32_t>{0}};
  serving::SampleKey key;
  std::vector<uint64_t> allowed;
};

Case MakeCase(const Combo& combo, int64_t vocab, std::mt19937_64& rng) {
  Case c;
  c.combo = combo;
  const auto v = static_cast<int32_t>(vocab);
  std::uniform_int_distribution<int32_t> any(0, v - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  // Peaked (scale 6) or flat (scale 1) rows.
  const float scale = unit(rng) < 0.5 ? 6.0f : 1.0f;
  std::normal_distribution<float> normal(0.0f, scale);
  c.logits.resize(static_cast<size_t>(vocab));
  for (float& x : c.logits) {
    x = unit(rng) < 0.005 ? -std::numeric_limits<float>::infinity() : normal(rng);
  }
  const auto top =
      static_cast<int32_t>(std::max_element(c.logits.begin(), c.logits.end()) - c.logits.begin());
  // Ties: the maximum at two more ids, a second value repeated, and +0.0 / -0.0.
  for (int i = 0; i < 2; ++i) c.logits[static_cast<size_t>(any(rng))] = c.logits[top];
  const float repeated = c.logits[static_cast<size_t>(any(rng))];
  for (int i = 0; i < 4; ++i) c.logits[static_cast<size_t>(any(rng))] = repeated;
  c.logits[static_cast<size_t>(any(rng))] = 0.0f;
  c.logits[static_cast<size_t>(any(rng))] = -0.0f;

  std::vector<int32_t> prompt = {top};
  for (int i = 0; i < 40; ++i) prompt.push_back(any(rng));
  c.history = serving::TokenHistory(prompt);
  for (int i = 0; i < 15; ++i) c.history.Append(i % 4 == 0 ? top : any(rng));
  c.end_ids = {top, any(rng)};

  serving::SamplingParams& p = c.params;
  p.temperature = combo.temperature;
  p.top_k = combo.top_k;
  p.top_p = combo.top_p;
  p.min_p = combo.min_p;
  if (combo.penalties) {
    p.repetition_penalty = 1.25;
    p.presence_penalty = 0.375;
    p.frequency_penalty = 0.25;
  }
  if (combo.bias) p.logit_bias = {{top, -2.5}, {any(rng), 4.0}, {any(rng), -100.0}};
  if (combo.min_tokens) p.min_tokens = static_cast<int32_t>(c.history.generated_length()) + 3;
  if (combo.logprobs >= 0) p.logprobs = combo.logprobs;
  if (combo.mask) {
    c.allowed.assign(static_cast<size_t>((vocab + 63) / 64), 0);
    for (int32_t t = 0; t < v; ++t) {
      if (unit(rng) < 0.5) c.allowed[static_cast<size_t>(t / 64)] |= uint64_t{1} << (t % 64);
    }
  }
  c.key = {rng(), static_cast<uint32_t>(rng() % 8), static_cast<uint32_t>(c.history.position())};
  return c;
}

struct Counts {
  int64_t rows = 0, sampled = 0, errors = 0;
  int64_t token_mismatches = 0, logprob_mismatches = 0, top_mismatches = 0, status_mismatches = 0;
};

void Compare(const Case& c, const absl::StatusOr<serving::SampledToken>& cpu,
             const absl::StatusOr<serving::SampledToken>& gpu, Counts* counts) {
  ++counts->rows;
  if (c.combo.temperature > 0) ++counts->sampled;
  if (cpu.ok() != gpu.ok() || (!cpu.ok() && cpu.status().code() != gpu.status().code())) {
    ++counts->status_mismatches;
    ADD_FAILURE() << "status: cpu " << cpu.status() << " gpu " << gpu.status();
    return;
  }
  if (!cpu.ok()) {
    ++counts->errors;
    return;
  }
  if (cpu->token != gpu->token) {
    if (++counts->token_mismatches <= 5) {
      std::printf(
          "token mismatch: T=%g top_k=%d top_p=%g min_p=%g pen=%d bias=%d min_tok=%d "
          "mask=%d: cpu %d (lp %g) gpu %d (lp %g)\n",
          c.combo.temperature, c.combo.top_k, c.combo.top_p, c.combo.min_p, c.combo.penalties,
          c.combo.bias, c.combo.min_tokens, c.combo.mask, cpu->token, cpu->logprob, gpu->token,
          gpu->logprob);
    }
    return;
  }
  if (!(std::abs(cpu->logprob - gpu->logprob) <= 1e-4f)) ++counts->logprob_mismatches;
  bool top_ok = cpu->top_logprobs.size() == gpu->top_logprobs.size();
  for (size_t i = 0; top_ok && i < cpu->top_logprobs.size(); ++i) {
    top_ok = cpu->top_logprobs[i].token == gpu->top_logprobs[i].token &&
             std::abs(cpu->top_logprobs[i].logprob - gpu->top_logprobs[i].logprob) <= 1e-4f;
  }
  if (!top_ok) ++counts->top_mismatches;
}

// Runs `grid` at `vocab` in batches of 1, 7, 64 (in turn) and returns the counts.
Counts RunGrid(const std::vector<Combo>& grid, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto sampler = GpuSampler::Create(64, vocab);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  Counts counts;
  if (!sampler.ok()) return counts;
  const int64_t stride = vocab + 8;  // rows not packed back to back
  float* logits = nullptr;
  EXPECT_EQ(cudaMalloc(&logits, static_cast<size_t>(64 * stride) * sizeof(float)), cudaSuccess);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const size_t batch_sizes[] = {1, 7, 64};
  size_t turn = 0;
  for (size_t begin = 0; begin < grid.size(); ++turn) {
    const size_t n = std::min(batch_sizes[turn % 3], grid.size() - begin);
    std::vector<Case> cases;
    for (size_t i = 0; i < n; ++i) cases.push_back(MakeCase(grid[begin + i], vocab, rng));
    std::vector<GpuSampleRow> rows;
    for (size_t i = 0; i < n; ++i) {
      const Case& c = cases[i];
      EXPECT_EQ(cudaMemcpy(logits + static_cast<int64_t>(i) * stride, c.logits.data(),
                           c.logits.size() * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
      rows.push_back({&c.params, c.end_ids, &c.history, c.key, c.allowed});
    }
    auto gpu = (*sampler)->Sample(logits, stride, rows, stream);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    if (!gpu.ok()) break;
    for (size_t i = 0; i < n; ++i) {
      const Case& c = cases[i];
      Compare(c, serving::SampleToken(c.logits, c.params, c.end_ids, c.history, c.key, c.allowed),
              (*gpu)[i], &counts);
    }
    begin += n;
  }
  cudaStreamDestroy(stream);
  cudaFree(logits);
  std::printf(
      "sampler_gpu vocab=%lld seed=%llu rows=%lld sampled=%lld errors=%lld "
      "token_mismatches=%lld logprob_mismatches=%lld top_logprob_mismatches=%lld "
      "status_mismatches=%lld\n",
      static_cast<long long>(vocab), static_cast<unsigned long long>(seed),
      static_cast<long long>(counts.rows), static_cast<long long>(counts.sampled),
      static_cast<long long>(counts.errors), static_cast<long long>(counts.token_mismatches),
      static_cast<long long>(counts.logprob_mismatches),
      static_cast<long long>(counts.top_mismatches),
      static_cast<long long>(counts.status_mismatches));
  return counts;
}

void ExpectNoMismatch(const Counts& counts, size_t grid_size) {
  EXPECT_EQ(counts.rows, static_cast<int64_t>(grid_size));
  EXPECT_EQ(counts.token_mismatches, 0);
  EXPECT_EQ(counts.logprob_mismatches, 0);
  EXPECT_EQ(counts.top_mismatches, 0);
  EXPECT_EQ(counts.status_mismatches, 0);
}

TEST(SamplerGpuTest, SmallVocabEveryCombinationMatchesCpu) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<Combo> grid = Grid(/*rotate_logprobs=*/false);
  ExpectNoMismatch(RunGrid(grid, 1000, std::random_device{}()), grid.size());
}

TEST(SamplerGpuTest, V4VocabEveryCombinationMatchesCpu) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<Combo> grid = Grid(/*rotate_logprobs=*/true);
  ExpectNoMismatch(RunGrid(grid, 129280, std::random_device{}()), grid.size());
}

// Rows whose every token is masked, and rows with NaN / +inf logits, fail as on the CPU.
// The memory plan counts the sampler's workspace with kernels/cuda/sampling_workspace.h, whose CUB
// part is what CUDA 13's CUB asks for; CUB answers only with a device (its size query reads the
// device's PTX version).
TEST(SamplerGpuTest, WorkspaceBytesAreThePlansFormula) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  for (int64_t rows : {1, 7, 64, 256, 4096}) {
    for (int64_t vocab : {300, 1000, 129280}) {
      if (rows * vocab >= (int64_t{1} << 31)) continue;
      EXPECT_EQ(kernels::cuda::sampling_workspace_bytes(rows, vocab),
                kernels::cuda::sampling_workspace::Bytes(rows, vocab))
          << rows << " x " << vocab;
    }
  }
}

TEST(SamplerGpuTest, ErrorsMatchCpu) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kVocab = 300;
  auto sampler = GpuSampler::Create(4, kVocab);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  std::mt19937_64 rng(std::random_device{}());
  Combo combo;
  combo.temperature = 1.0;
  std::vector<Case> cases;
  for (int i = 0; i < 4; ++i) cases.push_back(MakeCase(combo, kVocab, rng));
  cases[0].allowed.assign(5, 0);  // nothing allowed
  cases[1].logits[17] = std::numeric_limits<float>::quiet_NaN();
  cases[2].logits[3] = std::numeric_limits<float>::infinity();
  float* logits = nullptr;
  ASSERT_EQ(cudaMalloc(&logits, 4 * kVocab * sizeof(float)), cudaSuccess);
  std::vector<GpuSampleRow> rows;
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(cudaMemcpy(logits + i * kVocab, cases[i].logits.data(), kVocab * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    const Case& c = cases[i];
    rows.push_back({&c.params, c.end_ids, &c.history, c.key, c.allowed});
  }
  auto gpu = (*sampler)->Sample(logits, kVocab, rows, nullptr);
  cudaFree(logits);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)[0].status().code(), absl::StatusCode::kFailedPrecondition);
  for (int i = 1; i < 3; ++i) {
    const Case& c = cases[i];
    const auto cpu = serving::SampleToken(c.logits, c.params, c.end_ids, c.history, c.key);
    EXPECT_EQ((*gpu)[i].status(), cpu.status());
    EXPECT_EQ(cpu.status().code(), absl::StatusCode::kInvalidArgument);
  }
  ASSERT_TRUE((*gpu)[3].ok()) << (*gpu)[3].status();
  const Case& c = cases[3];
  const auto cpu = serving::SampleToken(c.logits, c.params, c.end_ids, c.history, c.key);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*gpu)[3]->token, cpu->token);
}

}  // namespace
}  // namespace pdserve::runtime
