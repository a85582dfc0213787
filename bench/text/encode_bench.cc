// Single-threaded encode throughput of text::Tokenizer.
//
//   pdserve_text_encode_bench MODEL_DIR CHUNKS_FILE [REPEATS]
// CHUNKS_FILE holds the input as chunks separated by a NUL byte (each chunk is one Encode call,
// like one request). Prints one JSON line: bytes, tokens, best seconds over REPEATS timed passes
// after one warm-up pass, and MB/s (10^6 bytes per second).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "text/tokenizer.h"

namespace {

double EncodeAll(const pdserve::text::Tokenizer& tokenizer, const std::vector<std::string>& chunks,
                 size_t* tokens) {
  const auto start = std::chrono::steady_clock::now();
  size_t count = 0;
  for (const std::string& chunk : chunks) {
    auto ids = tokenizer.Encode(chunk, {.add_special_tokens = false});
    if (!ids.ok()) {
      std::fprintf(stderr, "encode failed: %s\n", ids.status().ToString().c_str());
      std::exit(1);
    }
    count += ids->size();
  }
  *tokens = count;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR CHUNKS_FILE [REPEATS]\n", argv[0]);
    return 2;
  }
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  auto tokenizer = pdserve::text::Tokenizer::Load(argv[1]);
  auto content = pdserve::text::ReadFile(argv[2]);
  if (!tokenizer.ok() || !content.ok()) {
    std::fprintf(stderr, "load failed: %s %s\n", tokenizer.status().ToString().c_str(),
                 content.status().ToString().c_str());
    return 1;
  }
  const std::vector<std::string> chunks = absl::StrSplit(*content, '\0', absl::SkipEmpty());
  size_t bytes = 0;
  for (const std::string& chunk : chunks) bytes += chunk.size();
  size_t tokens = 0;
  EncodeAll(**tokenizer, chunks, &tokens);
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) best = std::min(best, EncodeAll(**tokenizer, chunks, &tokens));
  std::printf(
      "{\"impl\": \"pdserve\", \"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.6f, "
      "\"mb_per_s\": %.3f}\n",
      bytes, tokens, best, bytes / best / 1e6);
  return 0;
}
