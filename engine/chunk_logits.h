// Which rows of a prompt chunk's logits a forward call returns (engine::Model::Forward on the
// CPU, engine::gpu::GpuModel::Forward / ForwardExporting on the GPU).
#pragma once

namespace pdserve::engine {

// A prefill samples only from a chunk's last token; every row's logits cost the head's
// [rows, hidden] x [hidden, vocab] product (and, on the GPU, the copy of [rows, vocab] fp32 to
// the host: 256 x 129280 x 4 B = 132 MB per V4-Flash chunk of 256 tokens).
enum class ChunkLogits {
  kAllRows,  // [tokens.size(), vocab_size]: every position (tests, scoring)
  kLastRow,  // [1, vocab_size]: the chunk's last token's row (what serving samples from)
};

}  // namespace pdserve::engine
