// serving::SampleToken for a batch of rows whose logits are on the GPU
// (kernels/cuda/sampling.cuh): the host packs each row's parameters, end ids, logit_bias,
// penalty history and allowed-token bitset into one pinned buffer, copies it with one
// cudaMemcpyAsync, runs the sampler on the logits where they are, and copies back only the
// SampledRow results (token, its logprob, up to 20 top logprobs): one synchronization per call.
//
// Same tokens as serving::SampleToken on the same logits, except where kernels/cuda/sampling.cuh
// says bit-identity is not guaranteed (exp() and the untruncated total's summation order: a draw
// within a few ulp of a running-sum boundary). Logprobs agree to float rounding.
//
// Penalty history: built per call from serving::TokenHistory as a sparse list of distinct tokens
// (O(distinct prompt tokens) per row when repetition_penalty != 1, O(distinct generated tokens)
// when a presence / frequency penalty is set, nothing otherwise); no history lives on the device.
//
// Thread-safety: not thread-safe; one caller (a step loop) at a time per GpuSampler.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/gpu/device_memory.h"
#include "kernels/cuda/sampling.cuh"
#include "serving/sampler.h"
#include "serving/sampling_params.h"
#include "serving/token_history.h"

namespace pdserve::runtime {

// One row of a GPU sampling call: SampleToken's arguments minus the logits
// (RequestSampler::PrepareDraw returns them). Pointers and spans must stay valid through the call.
using GpuSampleRow = serving::RequestSampler::DrawInputs;

class GpuSampler {
 public:
  // Device workspace for up to `max_rows` rows of `vocab` tokens (double and sort buffers: about
  // 24 bytes per logit, 200 MB at 64 x 129,280). InvalidArgument for sizes
  // kernels::cuda::sampling_workspace_bytes refuses; Internal for CUDA allocation errors.
  static absl::StatusOr<std::unique_ptr<GpuSampler>> Create(int64_t max_rows, int64_t vocab);

  // Samples rows.size() <= max_rows rows from device logits [rows, stride] fp32 (row i at
  // logits + i * stride) on `stream`, and synchronizes it. Per row: the SampledToken, or
  // SampleToken's error for that row (InvalidArgument for NaN / +inf logits, with the CPU's
  // message: that row's logits are copied to the host and rerun there; FailedPrecondition when
  // every token is masked; InvalidArgument for ids outside the vocabulary). The outer status is
  // an error only for CUDA failures or rows.size() > max_rows.
  absl::StatusOr<std::vector<absl::StatusOr<serving::SampledToken>>> Sample(
      const float* logits, int64_t stride, std::span<const GpuSampleRow> rows, cudaStream_t stream);

  int64_t max_rows() const { return max_rows_; }
  int64_t vocab() const { return vocab_; }

 private:
  GpuSampler(int64_t max_rows, int64_t vocab) : max_rows_(max_rows), vocab_(vocab) {}
  // Packs `rows` into the pinned staging buffer (growing both buffers when needed); sets the
  // device pointers of `batch`. Per-row id errors go to `row_errors`.
  absl::Status Pack(std::span<const GpuSampleRow> rows, kernels::cuda::SamplingBatch* batch,
                    size_t* bytes, std::vector<absl::Status>* row_errors);

  const int64_t max_rows_;
  const int64_t vocab_;
  engine::gpu::DeviceArray<char> workspace_;
  engine::gpu::DeviceArray<kernels::cuda::SampledRow> out_;
  engine::gpu::PinnedArray<kernels::cuda::SampledRow> out_host_;
  engine::gpu::DeviceArray<char> inputs_;
  engine::gpu::PinnedArray<char> inputs_host_;
  // Host scratch of Pack, kept to avoid allocations per call.
  std::vector<kernels::cuda::SamplingRow> rows_;
  std::vector<int32_t> end_ids_;
  std::vector<int32_t> bias_tokens_;
  std::vector<double> bias_values_;
  std::vector<kernels::cuda::HistoryEntry> history_;
  std::vector<uint32_t> mask_words_;
};

}  // namespace pdserve::runtime
