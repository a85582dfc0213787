// Load-time options of engine::Model: which implementation each switchable piece uses, and the
// test-only faults that the coherence guards are proven against (docs/guards.md).
//
// Switches (issue 9): every custom kernel and state feature can be replaced by its reference
// implementation per deployment (deploy config guards.reference_kernels), so a bad one is found by
// bisection. The pieces are the names of that config key: sparse_attention, indexer, fp8_state.
// On the CPU backend every piece already IS the reference (float32, kernels/cpu), so the list is
// validated and logged but changes nothing; the CUDA backend, once its engine path exists, honours
// it. Nothing here pretends otherwise: ImplementationSummary says "reference" for every piece.
//
// Faults are for tests only. They are never read from a deployment file; the CLI turns one on
// only from the environment variable kScrambleIndexerEnv and logs a warning when it does.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/fp8_emulation.h"

namespace pdserve::engine {

// A piece of the engine that has a custom implementation and a reference one.
enum class SwitchablePiece {
  kSparseAttention,  // CSA / HCA attention over gathered entries (kernels/cuda sparse decode)
  kIndexer,          // the lightning indexer's scores and top-k (kernels/cuda indexer)
  kFp8State,         // FP8 storage of the per-request state (reference: bf16 / fp32 state)
};

// The config name of `piece`: "sparse_attention", "indexer", "fp8_state".
const char* SwitchablePieceName(SwitchablePiece piece);
// Every piece, in enum order.
std::vector<SwitchablePiece> AllSwitchablePieces();
// Parses config names (guards.reference_kernels). InvalidArgument naming the first unknown one;
// duplicates are allowed and collapse.
absl::StatusOr<std::vector<SwitchablePiece>> ParseReferencePieces(
    const std::vector<std::string>& names);

// A deliberately wrong lightning indexer, to prove that `pdserve check` catches one. TEST ONLY.
enum class IndexerFault {
  kNone,
  // The top-k row's slots past the query's causal limit are not marked invalid (-1) but hold
  // slot numbers, so attention gathers compressed entries that do not exist yet: the bug class
  // of a top-k kernel that skips the "-1 beyond (t + 1) / m" fill, whose gather then reads
  // never-written rows. Those rows read as the pool's poison (serving::kPoisonWord, a NaN), what
  // unwritten pages hold in debug builds. Selections among valid entries (lowest scores instead
  // of highest, top-1 broadcast, no entries) and zero-filled rows were measured too: the bundled
  // model's output does not change enough for `pdserve check` to see them (docs/guards.md).
  kUnmaskedSlots,
};
// The CUDA engine turns any fault into its own wrong indexer instead
// (engine::gpu::GpuModelOptions::test_lowest_score_indexer, runtime/cuda/gpu_backend.h): its
// fixed-shape decode indexer keeps the lowest-scoring entries.

// The environment variable the CLI reads to turn kUnmaskedSlots on ("1"); anything else, or unset,
// leaves the indexer correct.
inline constexpr char kScrambleIndexerEnv[] = "PDSERVE_TEST_SCRAMBLE_INDEXER";

struct ModelOptions {
  // Pieces forced to their reference implementation (deploy config guards.reference_kernels).
  std::vector<SwitchablePiece> reference_pieces;
  // TEST ONLY: kNone in every deployment.
  IndexerFault indexer_fault = IndexerFault::kNone;
  // TEST ONLY (false in every deployment): the CUDA backend's storage precision
  // (engine/gpu/gpu_model.h), so its fp32-GEMM mode can be compared row for row and the effect
  // of each rounding measured alone. bf16_state: the keys of the state (window rows, compressed
  // entries, indexer keys) are rounded to bf16 where the CUDA engine stores them as bf16.
  // bf16_expert_input: the routed experts read their input rounded to bf16, as
  // kernels/cuda/moe.cuh does.
  bool bf16_state = false;
  bool bf16_expert_input = false;
  // TEST ONLY: the projections computed with the CUDA engine's FP8 arithmetic (activation
  // quantization, bf16 outputs), to measure what FP8 costs on a CPU (engine/fp8_emulation.h).
  Fp8Emulation fp8_emulation;
  // Both of the above: the CUDA engine's storage precision.
  void EmulateGpuStorage() { bf16_state = bf16_expert_input = true; }
};

// `base` with indexer_fault = kUnmaskedSlots when kScrambleIndexerEnv is "1", else unchanged.
ModelOptions WithTestFaultsFromEnvironment(ModelOptions base);

// A loud warning naming the fault and the variable when `options` carries a test-only fault, else
// "". Every command that honours kScrambleIndexerEnv prints it to stderr at startup.
std::string TestFaultWarning(const ModelOptions& options);

// One line for the startup log, e.g. "backend cpu: sparse_attention=reference indexer=reference
// fp8_state=reference (every CPU piece is the reference)" plus, when a fault is on,
// " TEST FAULT indexer=unmasked_slots".
std::string ImplementationSummary(const ModelOptions& options);

}  // namespace pdserve::engine
