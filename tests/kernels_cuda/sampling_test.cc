// kernels/cuda/sampling.cuh on its own (CUDA + GoogleTest only; the comparison with the CPU
// sampler over the whole parameter grid is tests/engine_gpu/sampler_gpu_test.cc): greedy rows
// pick the lowest id among tied maxima after the bitset, min_tokens, logit_bias and penalties;
// top_k = 1 at any temperature picks that same token; logprobs and top logprobs equal a host
// log-softmax in double; bad rows report their status; a two-token row's draws follow its
// probabilities. Fresh random logits (seed printed). Skips without a CUDA device.
#include "kernels/cuda/sampling.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;

// Device copies of one batch and its outputs.
struct Batch {
  std::vector<SamplingRow> rows;
  std::vector<int32_t> end_ids;
  std::vector<int32_t> bias_tokens;
  std::vector<double> bias_values;
  std::vector<HistoryEntry> history;
  std::vector<uint32_t> mask_words;
};

template <typename T>
T* Upload(const std::vector<T>& host, std::vector<void*>* owned) {
  if (host.empty()) return nullptr;
  void* p = nullptr;
  if (cudaMalloc(&p, host.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  owned->push_back(p);
  return static_cast<T*>(p);
}

// Runs sample_tokens on `logits` [rows, vocab] and returns the rows' results.
std::vector<SampledRow> Sample(const std::vector<float>& logits, int64_t vocab, const Batch& b) {
  const auto rows = static_cast<int64_t>(b.rows.size());
  std::vector<void*> owned;
  SamplingBatch batch;
  batch.rows = Upload(b.rows, &owned);
  batch.end_ids = Upload(b.end_ids, &owned);
  batch.bias_tokens = Upload(b.bias_tokens, &owned);
  batch.bias_values = Upload(b.bias_values, &owned);
  batch.history = Upload(b.history, &owned);
  batch.mask_words = Upload(b.mask_words, &owned);
  const float* d_logits = Upload(logits, &owned);
  std::vector<SampledRow> out(static_cast<size_t>(rows));
  SampledRow* d_out = Upload(out, &owned);
  const size_t bytes = sampling_workspace_bytes(rows, vocab);
  void* workspace = nullptr;
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(cudaMalloc(&workspace, bytes), cudaSuccess);
  owned.push_back(workspace);
  EXPECT_EQ(sample_tokens(d_logits, rows, vocab, vocab, batch, d_out, workspace, bytes, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.data(), d_out, out.size() * sizeof(SampledRow), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (void* p : owned) cudaFree(p);
  return out;
}

// log-softmax of `row` in double, as the CPU sampler takes it.
std::vector<double> LogSoftmax(const float* row, int64_t vocab) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < vocab; ++t) max = std::max<double>(max, row[t]);
  double sum = 0.0;
  for (int64_t t = 0; t < vocab; ++t) sum += std::exp(row[t] - max);
  std::vector<double> out(static_cast<size_t>(vocab));
  for (int64_t t = 0; t < vocab; ++t) out[static_cast<size_t>(t)] = row[t] - (max + std::log(sum));
  return out;
}

TEST(SamplingTest, GreedyAndTopKOneTakeTheProcessedArgmax) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  constexpr int64_t kVocab = 5000;
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int32_t> any(0, kVocab - 1);
  std::vector<float> logits(static_cast<size_t>(4 * kVocab));
  for (float& x : logits) x = normal(rng);
  Batch b;
  for (int r = 0; r < 4; ++r) {
    float* row = logits.data() + r * kVocab;
    const auto top = static_cast<int32_t>(std::max_element(row, row + kVocab) - row);
    const int32_t tie = any(rng);
    row[tie] = row[top];  // two maxima: the lower id wins
    SamplingRow s;
    s.temperature = r < 2 ? 0.0 : 1.3;
    s.top_k = r < 2 ? 0 : 1;
    s.seed = rng();
    if (r % 2 == 1) {
      // The maxima are masked out by min_tokens (end id) and a bias; a penalized third token.
      s.min_tokens = 3;
      s.end_begin = static_cast<int32_t>(b.end_ids.size());
      s.end_count = 1;
      b.end_ids.push_back(std::min(top, tie));
      s.bias_begin = static_cast<int32_t>(b.bias_tokens.size());
      s.bias_count = 1;
      b.bias_tokens.push_back(std::max(top, tie));
      b.bias_values.push_back(-50.0);
      s.repetition_penalty = 1.5;
      s.history_begin = static_cast<int32_t>(b.history.size());
      s.history_count = 1;
      b.history.push_back({any(rng), 2, 1});
    }
    b.rows.push_back(s);
  }
  const std::vector<SampledRow> out = Sample(logits, kVocab, b);
  for (int r = 0; r < 4; ++r) {
    // The host's processed row: the same edits in double, then the argmax (lowest id on ties).
    std::vector<double> z(logits.begin() + r * kVocab, logits.begin() + (r + 1) * kVocab);
    const SamplingRow& s = b.rows[static_cast<size_t>(r)];
    for (int i = 0; i < s.end_count; ++i) z[b.end_ids[s.end_begin + i]] = -INFINITY;
    for (int i = 0; i < s.bias_count; ++i) z[b.bias_tokens[s.bias_begin + i]] += -50.0;
    for (int i = 0; i < s.history_count; ++i) {
      double& v = z[b.history[s.history_begin + i].token];
      v = v > 0 ? v / 1.5 : v * 1.5;
    }
    const auto want = static_cast<int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
    EXPECT_EQ(out[static_cast<size_t>(r)].status, kSampleOk);
    EXPECT_EQ(out[static_cast<size_t>(r)].token, want) << "row " << r;
  }
}

TEST(SamplingTest, LogprobsAreTheRawLogSoftmax) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  constexpr int64_t kVocab = 129280;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(2 * kVocab));
  for (float& x : logits) x = normal(rng);
  logits[7] = -std::numeric_limits<float>::infinity();
  logits[100] = logits[200] = 40.0f;  // tied top two: id order
  Batch b;
  for (int r = 0; r < 2; ++r) {
    SamplingRow s;
    s.temperature = 0.8;
    s.top_p = 0.9;
    s.seed = rng();
    s.top_logprobs = r == 0 ? kMaxSampleTopLogprobs : 3;
    b.rows.push_back(s);
  }
  const std::vector<SampledRow> out = Sample(logits, kVocab, b);
  for (int r = 0; r < 2; ++r) {
    const SampledRow& o = out[static_cast<size_t>(r)];
    const float* row = logits.data() + r * kVocab;
    const std::vector<double> want = LogSoftmax(row, kVocab);
    ASSERT_EQ(o.status, kSampleOk);
    EXPECT_NEAR(o.logprob, want[static_cast<size_t>(o.token)], 1e-5);
    std::vector<int32_t> order(static_cast<size_t>(kVocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t c) { return row[a] > row[c]; });
    ASSERT_EQ(o.num_top, b.rows[static_cast<size_t>(r)].top_logprobs);
    for (int i = 0; i < o.num_top; ++i) {
      EXPECT_EQ(o.top_tokens[i], order[static_cast<size_t>(i)]) << "rank " << i;
      EXPECT_NEAR(o.top_logprobs[i], want[static_cast<size_t>(order[static_cast<size_t>(i)])],
                  1e-5);
    }
  }
}

TEST(SamplingTest, BadRowsReportTheirStatus) {
  PDSERVE_SKIP_WITHOUT_GPU();
  constexpr int64_t kVocab = 100;
  std::vector<float> logits(static_cast<size_t>(3 * kVocab), 0.5f);
  logits[kVocab + 9] = std::numeric_limits<float>::quiet_NaN();
  Batch b;
  b.mask_words.assign(4, 0u);  // row 0: nothing allowed
  SamplingRow masked;
  masked.mask_word = 0;
  b.rows = {masked, SamplingRow{}, SamplingRow{}};
  const std::vector<SampledRow> out = Sample(logits, kVocab, b);
  EXPECT_EQ(out[0].status, kSampleAllMasked);
  EXPECT_EQ(out[1].status, kSampleBadLogits);
  EXPECT_EQ(out[2].status, kSampleOk);
}

// Two tokens with probabilities 0.2 / 0.8 at T = 1 over 4000 seeds: the count of the first lies
// within 5 standard deviations of 800.
TEST(SamplingTest, DrawsFollowTheProbabilities) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  constexpr int64_t kRows = 4000;
  constexpr int64_t kVocab = 2;
  std::vector<float> logits;
  Batch b;
  for (int64_t r = 0; r < kRows; ++r) {
    logits.push_back(static_cast<float>(std::log(0.2)));
    logits.push_back(static_cast<float>(std::log(0.8)));
    SamplingRow s;
    s.seed = rng();
    s.position = static_cast<uint32_t>(r);
    b.rows.push_back(s);
  }
  const std::vector<SampledRow> out = Sample(logits, kVocab, b);
  int64_t first = 0;
  for (const SampledRow& o : out) first += o.token == 0 ? 1 : 0;
  EXPECT_NEAR(static_cast<double>(first), 800.0, 5.0 * std::sqrt(4000 * 0.2 * 0.8));
}

}  // namespace
}  // namespace pdserve::kernels::cuda
