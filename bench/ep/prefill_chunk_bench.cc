// Prefill time on the CUDA engine against the block a prompt is cut at and the logits rows each
// call brings to the host (docs/engine-gpu.md, "Prompt chunks" and "Prompt chunks' logits"):
// one GpuModel with DeepSeek-V4-Flash attention and dense shapes (bench/ep/flash_shapes.h:
// hidden 4096, CSA / HCA alternating, vocab 129280 by default) and --experts routed experts per
// layer (the real 256 do not fit the host's random-weight build at useful layer counts; fewer
// experts make each call's weight read smaller than the real model's, so the gain from larger
// blocks here is a lower bound), random bf16 weights. Per prompt length, block and logits rows:
// the slot reset, then the prompt through Forward calls cut at absolute multiples of the block
// (as runtime::GpuPrefillEngine cuts it), host wall time to the last call's logits (every call
// synchronizes, as the engine's do). Medians over --repeats after one warm-up per block.
//
// Columns: prompt tokens, block, logits rows (all: [block, vocab] fp32 per call to the host;
// last: [1, vocab]), calls, prefill ms, tokens / s, ms per call, and the speed-up against the
// 64-token block with all rows (what the serving paths run by default). Markdown on stdout,
// progress on stderr. Needs a GPU (tools/gpu/run_prefill_chunk.sh).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/ep/flash_shapes.h"
#include "common/status.h"
#include "engine/gpu/gpu_model.h"
#include "engine/random_weights.h"

namespace pdserve::bench {
namespace {

using engine::gpu::ChunkLogits;
using engine::gpu::GpuModel;

struct Flags {
  int64_t layers = 4;
  int64_t experts = 16;
  int64_t vocab = 129280;
  std::string lengths = "4096,16384";
  std::string blocks = "64,256,1024,4096";
  std::string logits = "all,last";
  int64_t repeats = 2;
};

absl::StatusOr<std::vector<int64_t>> Numbers(const std::string& list, const char* what) {
  std::vector<int64_t> out;
  for (absl::string_view piece : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(piece, &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", what, ": bad entry ", piece));
    }
    out.push_back(n);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", what, " is empty"));
  return out;
}

// The prompt's prefill: the slot reset, then Forward calls cut at multiples of `block`.
absl::StatusOr<double> Prefill(GpuModel& gpu, const std::vector<int32_t>& prompt, int64_t block,
                               ChunkLogits rows, int64_t* calls) {
  PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(0));
  const auto started = Clock::now();
  const auto length = static_cast<int64_t>(prompt.size());
  *calls = 0;
  for (int64_t from = 0; from < length;) {
    const int64_t to = std::min(length, (from / block + 1) * block);
    const std::vector<int32_t> piece(prompt.begin() + from, prompt.begin() + to);
    PDSERVE_ASSIGN_OR_RETURN(const engine::Tensor logits, gpu.Forward(0, piece, 0, rows));
    if (logits.dim(0) < 1) return absl::InternalError("no logits row came back");
    ++*calls;
    from = to;
  }
  return Seconds(started) * 1e3;
}

absl::Status Run(const Flags& flags) {
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<int64_t> lengths, Numbers(flags.lengths, "lengths"));
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<int64_t> blocks, Numbers(flags.blocks, "blocks"));
  std::vector<ChunkLogits> row_kinds;
  for (absl::string_view kind : absl::StrSplit(flags.logits, ',', absl::SkipEmpty())) {
    if (kind != "all" && kind != "last") {
      return absl::InvalidArgumentError("--logits: all and / or last");
    }
    row_kinds.push_back(kind == "last" ? ChunkLogits::kLastRow : ChunkLogits::kAllRows);
  }
  engine::ModelConfig config = FlashShapes(flags.layers, flags.vocab);
  config.n_routed_experts = flags.experts;
  config.num_experts_per_tok = std::min<int64_t>(config.num_experts_per_tok, flags.experts);
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  config.max_position_embeddings = longest + 64;
  std::fprintf(stderr, "making %lld layers with %lld experts (random weights)\n",
               static_cast<long long>(flags.layers), static_cast<long long>(flags.experts));
  engine::gpu::GpuModelOptions options;
  options.slots = 1;
  options.max_context = config.max_position_embeddings;
  options.max_chunk = *std::max_element(blocks.begin(), blocks.end());
  std::unique_ptr<GpuModel> gpu;
  {
    const engine::Weights weights = engine::FastRandomWeights(config, 1);
    PDSERVE_ASSIGN_OR_RETURN(gpu, GpuModel::Create(config, weights, options));
  }
  std::printf(
      "| prompt tokens | block | logits rows | calls | prefill ms | tokens / s | ms per call | "
      "speed-up vs 64 all |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const int64_t length : lengths) {
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < length; ++i) {
      prompt.push_back(static_cast<int32_t>((31 * i + 5) % config.vocab_size));
    }
    double baseline = 0;
    for (const int64_t block : blocks) {
      for (const ChunkLogits rows : row_kinds) {
        int64_t calls = 0;
        // One warm-up (first-use allocations, cuBLAS heuristics), then the repeats.
        PDSERVE_RETURN_IF_ERROR(Prefill(*gpu, prompt, block, rows, &calls).status());
        std::vector<double> ms;
        for (int64_t r = 0; r < flags.repeats; ++r) {
          PDSERVE_ASSIGN_OR_RETURN(const double t, Prefill(*gpu, prompt, block, rows, &calls));
          ms.push_back(t);
        }
        const double median = Median(ms);
        const bool all = rows == ChunkLogits::kAllRows;
        if (block == 64 && all) baseline = median;
        std::printf("| %lld | %lld | %s | %lld | %.1f | %.0f | %.2f | %s |\n",
                    static_cast<long long>(length), static_cast<long long>(block),
                    all ? "all" : "last", static_cast<long long>(calls), median,
                    static_cast<double>(length) / (median / 1e3),
                    median / static_cast<double>(calls),
                    baseline > 0 ? absl::StrFormat("%.2fx", baseline / median).c_str() : "-");
        std::fflush(stdout);
        std::fprintf(stderr, "%lld tokens, block %lld, %s rows: %.1f ms\n",
                     static_cast<long long>(length), static_cast<long long>(block),
                     all ? "all" : "last", median);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app("CUDA prefill time against the prompt block and the logits rows brought back");
  app.add_option("--layers", flags.layers, "V4-Flash-shaped layers")->capture_default_str();
  app.add_option("--experts", flags.experts, "Routed experts per layer")->capture_default_str();
  app.add_option("--vocab", flags.vocab, "Vocabulary (V4: 129280)")->capture_default_str();
  app.add_option("--lengths", flags.lengths, "Prompt lengths, comma-separated")
      ->capture_default_str();
  app.add_option("--blocks", flags.blocks, "Blocks the prompt is cut at, comma-separated")
      ->capture_default_str();
  app.add_option("--logits", flags.logits, "Logits rows per call: all, last or all,last")
      ->capture_default_str();
  app.add_option("--repeats", flags.repeats, "Timed prefills per setting (median)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const absl::Status status = pdserve::bench::Run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "prefill_chunk_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
