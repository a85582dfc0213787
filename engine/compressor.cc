#include "engine/compressor.h"

#include <vector>

#include "engine/quant.h"
#include "kernels/cpu/gated_pool.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

Compressor::Compressor(const Weights& weights, const std::string& prefix, int64_t rate, int64_t dim,
                       bool overlapping, int64_t hidden, float norm_eps, const RopeTable* rope,
                       bool bf16_entries, Fp8Emulation fp8)
    : rate_(rate),
      dim_(dim),
      overlapping_(overlapping),
      width_(overlapping ? 2 * dim : dim),
      hidden_(hidden),
      norm_eps_(norm_eps),
      rope_(rope),
      bf16_entries_(bf16_entries),
      fp8_(fp8.ForDense()),
      kv_proj_(weights.At(prefix + ".kv_proj.weight")),
      gate_proj_(weights.At(prefix + ".gate_proj.weight")),
      position_bias_(weights.At(prefix + ".position_bias")),
      kv_norm_(weights.At(prefix + ".kv_norm.weight")) {}

CompressorState Compressor::NewState() const {
  CompressorState s;
  s.buffer_kv = Tensor({0, width_});
  s.buffer_gate = Tensor({0, width_});
  s.overlap_kv = Tensor({0, dim_});
  s.overlap_gate = Tensor({0, dim_});
  s.entries = Tensor({0, dim_});
  return s;
}

void Compressor::Extend(const float* x, int64_t tokens, CompressorState* state) const {
  if (tokens == 0) return;
  std::vector<float> kv(static_cast<size_t>(tokens * width_));
  std::vector<float> gate(kv.size());
  EmulatedLinear(fp8_, x, tokens, hidden_, kv_proj_.ptr(), width_, kv.data());
  EmulatedLinear(fp8_, x, tokens, hidden_, gate_proj_.ptr(), width_, gate.data());
  AppendRows(&state->buffer_kv, kv.data(), tokens);
  AppendRows(&state->buffer_gate, gate.data(), tokens);

  int64_t consumed = 0;
  while (state->buffer_kv.dim(0) - consumed >= rate_) {
    EmitEntry(state->buffer_kv.ptr() + consumed * width_,
              state->buffer_gate.ptr() + consumed * width_, state);
    consumed += rate_;
  }
  DropFrontRows(&state->buffer_kv, consumed);
  DropFrontRows(&state->buffer_gate, consumed);
}

// kv, gate: the window's `rate_` raw rows of width_ floats.
void Compressor::EmitEntry(const float* kv, const float* gate, CompressorState* state) const {
  // Slot layout (as in the reference): the previous window's Ca rows first, then this window's
  // rows (their Cb half when overlapping).
  const int64_t own_offset = overlapping_ ? dim_ : 0;
  const bool has_overlap = overlapping_ && state->overlap_kv.dim(0) == rate_;
  const int64_t slots = has_overlap ? 2 * rate_ : rate_;
  std::vector<float> biased_gate(static_cast<size_t>(slots * dim_));
  std::vector<const float*> kv_rows;
  std::vector<const float*> gate_rows;
  const float* bias = position_bias_.ptr();
  int64_t slot = 0;
  if (has_overlap) {
    for (int64_t r = 0; r < rate_; ++r, ++slot) {
      float* g = biased_gate.data() + slot * dim_;
      for (int64_t c = 0; c < dim_; ++c) {
        g[c] = state->overlap_gate.ptr()[r * dim_ + c] + bias[r * width_ + c];
      }
      kv_rows.push_back(state->overlap_kv.ptr() + r * dim_);
      gate_rows.push_back(g);
    }
  }
  for (int64_t r = 0; r < rate_; ++r, ++slot) {
    float* g = biased_gate.data() + slot * dim_;
    for (int64_t c = 0; c < dim_; ++c) {
      g[c] = gate[r * width_ + own_offset + c] + bias[r * width_ + own_offset + c];
    }
    kv_rows.push_back(kv + r * width_ + own_offset);
    gate_rows.push_back(g);
  }

  std::vector<float> entry(static_cast<size_t>(dim_));
  cpu::GatedPool(kv_rows.data(), gate_rows.data(), slots, dim_, entry.data());
  cpu::RmsNorm(entry.data(), kv_norm_.ptr(), 1, dim_, norm_eps_, entry.data());
  std::vector<float> cos;
  std::vector<float> sin;
  rope_->Compute({state->entries.dim(0) * rate_}, &cos, &sin);
  cpu::ApplyInterleavedRope(entry.data(), 1, dim_, 1, dim_, rope_->rope_dim(), cos.data(),
                            sin.data(), /*inverse=*/false);
  if (bf16_entries_) RoundToBf16(entry.data(), dim_);
  AppendRows(&state->entries, entry.data(), 1);

  if (overlapping_) {
    state->overlap_kv = Tensor({rate_, dim_});
    state->overlap_gate = Tensor({rate_, dim_});
    for (int64_t r = 0; r < rate_; ++r) {
      for (int64_t c = 0; c < dim_; ++c) {
        state->overlap_kv.ptr()[r * dim_ + c] = kv[r * width_ + c];
        state->overlap_gate.ptr()[r * dim_ + c] = gate[r * width_ + c];
      }
    }
  }
}

}  // namespace pdserve::engine
