// What identifies the model a worker computes with, so that a router can refuse a worker that
// serves another model (or the same one with other weights) under the same name
// (docs/operations.md, "Model identity").
//
// Thread-safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace pdserve::common {

// xxh3-64 fingerprint of the model directory `model_dir`, cheap for a checkpoint of hundreds of
// GB: it hashes, in this order,
//   - each of config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
//     random_weights.json (its seed) and model.safetensors.index.json that exists: its name and
//     all its bytes;
//   - each safetensors file of the checkpoint (the index's weight_map files, else
//     model.safetensors), in name order: its name, its size, its whole header (every tensor's
//     name, dtype, shape and offsets) and kFingerprintSamples samples of kFingerprintSampleBytes
//     bytes spread evenly over its data (the first and the last included).
// So two directories with the same files fingerprint alike wherever they lie, and a change of
// config, tokenizer, random seed, tensor layout, or of weights at a sampled place changes it.
// Weights changed only between the samples are not seen: this guards against a worker started
// on the wrong directory, not against a tampered checkpoint. Reads about 1 MiB per file.
// Errors: NotFound when config.json is missing; InvalidArgument for an index that is not JSON
// or a safetensors file shorter than its header says; the I/O error of a file that cannot be
// read.
inline constexpr int kFingerprintSamples = 16;
inline constexpr int64_t kFingerprintSampleBytes = 4096;
absl::StatusOr<uint64_t> ModelFingerprint(const std::string& model_dir);

// Whether `model_dir` holds weights to fingerprint (a checkpoint or random_weights.json), rather
// than only the config and tokenizer a router needs.
bool HasWeightsFiles(const std::string& model_dir);

// The fingerprint as 16 lower-case hex digits.
std::string FingerprintHex(uint64_t fingerprint);

// The fingerprint as every log line and error message prints it (docs/operations.md, "Model
// identity"): "0x" + FingerprintHex, then the decimal number in parentheses, which is how the
// Health RPC's uint64 model_fingerprint reads in protobuf's text and JSON forms, so either can be
// matched against a log: "0x000000000000002a (42)".
std::string FingerprintText(uint64_t fingerprint);

}  // namespace pdserve::common
