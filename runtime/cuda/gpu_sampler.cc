#include "runtime/cuda/gpu_sampler.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::runtime {
namespace {

namespace kc = kernels::cuda;

constexpr size_t kSectionAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

absl::Status CheckId(const char* what, int32_t token, int64_t vocab) {
  if (token >= 0 && token < vocab) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " token id ", token, " is outside the logits [0, ", vocab, ")"));
}

// The distinct tokens the row's penalties touch (GpuSampler's header), appended to `out`.
absl::Status AppendHistory(const serving::SamplingParams& params,
                           const serving::TokenHistory& history, int64_t vocab,
                           std::vector<kc::HistoryEntry>* out) {
  const bool repeat = params.repetition_penalty != 1.0;
  const bool counted = params.presence_penalty != 0.0 || params.frequency_penalty != 0.0;
  if (repeat) {
    for (int32_t token : history.prompt_tokens()) {
      PDSERVE_RETURN_IF_ERROR(CheckId("history", token, vocab));
      const auto it = history.generated_counts().find(token);
      const int32_t count = it == history.generated_counts().end() ? 0 : it->second;
      out->push_back({token, counted ? count : 0, 1});
    }
  }
  if (!repeat && !counted) return absl::OkStatus();
  for (const auto& [token, count] : history.generated_counts()) {
    PDSERVE_RETURN_IF_ERROR(CheckId("history", token, vocab));
    if (repeat && history.prompt_tokens().contains(token)) continue;  // listed above
    out->push_back({token, counted ? count : 0, repeat ? 1 : 0});
  }
  return absl::OkStatus();
}

serving::SampledToken ToSampledToken(const kc::SampledRow& row,
                                     const serving::SamplingParams& params) {
  serving::SampledToken token;
  token.token = row.token;
  token.logprob = row.logprob;
  if (params.logprobs) {
    for (int32_t i = 0; i < row.num_top; ++i) {
      token.top_logprobs.push_back({row.top_tokens[i], row.top_logprobs[i]});
    }
  }
  return token;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSampler>> GpuSampler::Create(int64_t max_rows, int64_t vocab) {
  const size_t bytes = kc::sampling_workspace_bytes(max_rows, vocab);
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("GPU sampler: ", max_rows, " rows of vocab ",
                                                   vocab, " are outside the kernel's limits"));
  }
  std::unique_ptr<GpuSampler> sampler(new GpuSampler(max_rows, vocab));
  PDSERVE_RETURN_IF_ERROR(sampler->workspace_.Allocate(bytes));
  PDSERVE_RETURN_IF_ERROR(sampler->out_.Allocate(static_cast<size_t>(max_rows)));
  PDSERVE_RETURN_IF_ERROR(sampler->out_host_.Allocate(static_cast<size_t>(max_rows)));
  return sampler;
}

absl::Status GpuSampler::Pack(std::span<const GpuSampleRow> rows, kc::SamplingBatch* batch,
                              size_t* bytes, std::vector<absl::Status>* row_errors) {
  rows_.clear();
  end_ids_.clear();
  bias_tokens_.clear();
  bias_values_.clear();
  history_.clear();
  mask_words_.clear();
  const auto words = static_cast<size_t>((vocab_ + 31) / 32);
  for (size_t i = 0; i < rows.size(); ++i) {
    const GpuSampleRow& in = rows[i];
    const serving::SamplingParams& p = *in.params;
    kc::SamplingRow row;
    row.temperature = p.temperature;
    row.top_p = p.top_p;
    row.min_p = p.min_p;
    row.repetition_penalty = p.repetition_penalty;
    row.presence_penalty = p.presence_penalty;
    row.frequency_penalty = p.frequency_penalty;
    row.seed = in.key.seed;
    row.choice = in.key.choice;
    row.position = in.key.position;
    row.top_k = p.top_k;
    row.top_logprobs = std::min(p.logprobs.value_or(0), kc::kMaxSampleTopLogprobs);
    row.generated = static_cast<int32_t>(in.history->generated_length());
    row.min_tokens = p.min_tokens;
    absl::Status& error = (*row_errors)[i];
    row.end_begin = static_cast<int32_t>(end_ids_.size());
    if (row.generated < row.min_tokens) {
      for (int32_t token : in.end_token_ids) {
        if (error.ok()) error = CheckId("end", token, vocab_);
        end_ids_.push_back(std::clamp<int32_t>(token, 0, static_cast<int32_t>(vocab_ - 1)));
      }
    }
    row.end_count = static_cast<int32_t>(end_ids_.size()) - row.end_begin;
    row.bias_begin = static_cast<int32_t>(bias_tokens_.size());
    for (const auto& [token, bias] : p.logit_bias) {
      if (error.ok()) error = CheckId("logit_bias", token, vocab_);
      if (token < 0 || token >= vocab_) continue;
      bias_tokens_.push_back(token);
      bias_values_.push_back(bias);
    }
    row.bias_count = static_cast<int32_t>(bias_tokens_.size()) - row.bias_begin;
    row.history_begin = static_cast<int32_t>(history_.size());
    const absl::Status history = AppendHistory(p, *in.history, vocab_, &history_);
    if (error.ok()) error = history;
    if (!history.ok()) history_.resize(static_cast<size_t>(row.history_begin));
    row.history_count = static_cast<int32_t>(history_.size()) - row.history_begin;
    if (!in.allowed.empty()) {
      row.mask_word = static_cast<int64_t>(mask_words_.size());
      mask_words_.resize(mask_words_.size() + words, 0u);
      // Little-endian: uint64 word w holds uint32 words 2w (low) and 2w + 1.
      const size_t copy = std::min(words, in.allowed.size() * 2);
      std::memcpy(mask_words_.data() + row.mask_word, in.allowed.data(), copy * sizeof(uint32_t));
    }
    rows_.push_back(row);
  }
  // Sections of the one staging buffer, in SamplingBatch's order.
  const size_t sizes[] = {
      rows_.size() * sizeof(kc::SamplingRow),     end_ids_.size() * sizeof(int32_t),
      bias_tokens_.size() * sizeof(int32_t),      bias_values_.size() * sizeof(double),
      history_.size() * sizeof(kc::HistoryEntry), mask_words_.size() * sizeof(uint32_t)};
  const void* sources[] = {rows_.data(),        end_ids_.data(), bias_tokens_.data(),
                           bias_values_.data(), history_.data(), mask_words_.data()};
  size_t offsets[6];
  size_t total = 0;
  for (int s = 0; s < 6; ++s) {
    offsets[s] = total;
    total += AlignUp(sizes[s]);
  }
  if (inputs_host_.size() < total) {
    PDSERVE_RETURN_IF_ERROR(inputs_host_.Allocate(total * 2));
    PDSERVE_RETURN_IF_ERROR(inputs_.Allocate(total * 2));
  }
  for (int s = 0; s < 6; ++s) {
    if (sizes[s] > 0) std::memcpy(inputs_host_.get() + offsets[s], sources[s], sizes[s]);
  }
  char* device = inputs_.get();
  auto at = [&](int s) { return sizes[s] > 0 ? device + offsets[s] : nullptr; };
  batch->rows = reinterpret_cast<const kc::SamplingRow*>(at(0));
  batch->end_ids = reinterpret_cast<const int32_t*>(at(1));
  batch->bias_tokens = reinterpret_cast<const int32_t*>(at(2));
  batch->bias_values = reinterpret_cast<const double*>(at(3));
  batch->history = reinterpret_cast<const kc::HistoryEntry*>(at(4));
  batch->mask_words = reinterpret_cast<const uint32_t*>(at(5));
  *bytes = total;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::StatusOr<serving::SampledToken>>> GpuSampler::Sample(
    const float* logits, int64_t stride, std::span<const GpuSampleRow> rows, cudaStream_t stream) {
  const auto n = static_cast<int64_t>(rows.size());
  if (n > max_rows_) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU sampler: ", n, " rows, at most ", max_rows_));
  }
  std::vector<absl::StatusOr<serving::SampledToken>> results;
  if (n == 0) return results;
  std::vector<absl::Status> row_errors(rows.size());
  kc::SamplingBatch batch;
  size_t bytes = 0;
  PDSERVE_RETURN_IF_ERROR(Pack(rows, &batch, &bytes, &row_errors));
  PDSERVE_CUDA_RETURN(
      cudaMemcpyAsync(inputs_.get(), inputs_host_.get(), bytes, cudaMemcpyHostToDevice, stream));
  PDSERVE_CUDA_RETURN(kc::sample_tokens(logits, n, stride, vocab_, batch, out_.get(),
                                        workspace_.get(), workspace_.size(), stream));
  PDSERVE_CUDA_RETURN(cudaMemcpyAsync(out_host_.get(), out_.get(),
                                      static_cast<size_t>(n) * sizeof(kc::SampledRow),
                                      cudaMemcpyDeviceToHost, stream));
  PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < rows.size(); ++i) {
    const kc::SampledRow& row = out_host_[i];
    if (!row_errors[i].ok()) {
      results.push_back(row_errors[i]);
    } else if (row.status == kc::kSampleOk) {
      results.push_back(ToSampledToken(row, *rows[i].params));
    } else if (row.status == kc::kSampleAllMasked) {
      results.push_back(absl::FailedPreconditionError(
          "every token is masked (min_tokens, logit_bias, response_format or -inf logits)"));
    } else {
      // NaN / +inf: the host sampler names the token.
      std::vector<float> host(static_cast<size_t>(vocab_));
      PDSERVE_CUDA_RETURN(cudaMemcpy(host.data(), logits + static_cast<int64_t>(i) * stride,
                                     host.size() * sizeof(float), cudaMemcpyDeviceToHost));
      results.push_back(serving::SampleToken(host, *rows[i].params, rows[i].end_token_ids,
                                             *rows[i].history, rows[i].key, rows[i].allowed));
    }
  }
  return results;
}

}  // namespace pdserve::runtime
