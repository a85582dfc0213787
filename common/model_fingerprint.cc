#include "common/model_fingerprint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace pdserve::common {
namespace {

namespace fs = std::filesystem;

constexpr const char* kWholeFiles[] = {"config.json",         "generation_config.json",
                                       "tokenizer.json",      "tokenizer_config.json",
                                       "random_weights.json", "model.safetensors.index.json"};
// A safetensors header larger than this is not a header (the format caps it at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

class Hasher {
 public:
  Hasher() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~Hasher() { XXH3_freeState(state_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void Add(const void* data, size_t bytes) { XXH3_64bits_update(state_, data, bytes); }
  void Add(const std::string& s) {
    const uint64_t size = s.size();  // length-prefixed: "ab"+"c" differs from "a"+"bc"
    Add(&size, sizeof(size));
    Add(s.data(), s.size());
  }
  uint64_t Digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

absl::StatusOr<std::string> ReadRange(std::ifstream& in, const std::string& path, uint64_t offset,
                                      uint64_t bytes) {
  std::string out(bytes, '\0');
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(out.data(), static_cast<std::streamsize>(bytes));
  if (!in || static_cast<uint64_t>(in.gcount()) != bytes) {
    return absl::DataLossError(absl::StrCat(path, ": cannot read ", bytes, " bytes at ", offset));
  }
  return out;
}

absl::StatusOr<std::string> ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": ", ec.message()));
  return ReadRange(in, path, 0, size);
}

// The checkpoint's safetensors files, sorted by name; none for a random_weights.json directory.
absl::StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& dir) {
  std::set<std::string> files;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index, ec)) {
    absl::StatusOr<std::string> text = ReadWhole(index.string());
    if (!text.ok()) return text.status();
    const nlohmann::json json = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded() || !json.contains("weight_map") || !json["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index.string(), ": no weight_map object"));
    }
    for (const auto& [name, file] : json["weight_map"].items()) {
      if (!file.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index.string(), ": weight_map[\"", name, "\"] is not a file name"));
      }
      files.insert(file.get<std::string>());
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors", ec)) {
    files.insert("model.safetensors");
  }
  return std::vector<std::string>(files.begin(), files.end());
}

absl::Status HashSafetensors(const std::string& dir, const std::string& name, Hasher& hasher) {
  const std::string path = (fs::path(dir) / name).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": ", ec.message()));
  hasher.Add(name);
  hasher.Add(&size, sizeof(size));
  absl::StatusOr<std::string> prefix = ReadRange(in, path, 0, std::min<uint64_t>(8, size));
  if (!prefix.ok()) return prefix.status();
  uint64_t header_bytes = 0;
  for (size_t i = 0; i < prefix->size(); ++i) {
    header_bytes |= static_cast<uint64_t>(static_cast<unsigned char>((*prefix)[i])) << (8 * i);
  }
  if (size < 8 || header_bytes > kMaxHeaderBytes || 8 + header_bytes > size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a safetensors file (header of ",
                                                   header_bytes, " bytes in a file of ", size,
                                                   ")"));
  }
  absl::StatusOr<std::string> header = ReadRange(in, path, 8, header_bytes);
  if (!header.ok()) return header.status();
  hasher.Add(*header);
  const uint64_t data_begin = 8 + header_bytes;
  const uint64_t data_bytes = size - data_begin;
  const uint64_t sample = std::min<uint64_t>(kFingerprintSampleBytes, data_bytes);
  if (sample == 0) return absl::OkStatus();
  const uint64_t span = data_bytes - sample;  // the last sample ends at the file's end
  for (int i = 0; i < kFingerprintSamples; ++i) {
    const uint64_t offset = data_begin + span / (kFingerprintSamples - 1) * i +
                            (i == kFingerprintSamples - 1 ? span % (kFingerprintSamples - 1) : 0);
    absl::StatusOr<std::string> bytes = ReadRange(in, path, offset, sample);
    if (!bytes.ok()) return bytes.status();
    hasher.Add(*bytes);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ModelFingerprint(const std::string& model_dir) {
  Hasher hasher;
  std::error_code ec;
  if (!fs::exists(fs::path(model_dir) / "config.json", ec)) {
    return absl::NotFoundError(absl::StrCat(model_dir, ": no config.json"));
  }
  for (const char* name : kWholeFiles) {
    const fs::path path = fs::path(model_dir) / name;
    if (!fs::exists(path, ec)) continue;
    absl::StatusOr<std::string> text = ReadWhole(path.string());
    if (!text.ok()) return text.status();
    hasher.Add(name);
    hasher.Add(*text);
  }
  absl::StatusOr<std::vector<std::string>> files = CheckpointFiles(model_dir);
  if (!files.ok()) return files.status();
  for (const std::string& name : *files) {
    if (absl::Status s = HashSafetensors(model_dir, name, hasher); !s.ok()) return s;
  }
  return hasher.Digest();
}

bool HasWeightsFiles(const std::string& model_dir) {
  std::error_code ec;
  for (const char* name :
       {"model.safetensors", "model.safetensors.index.json", "random_weights.json"}) {
    if (fs::exists(fs::path(model_dir) / name, ec)) return true;
  }
  return false;
}

std::string FingerprintHex(uint64_t fingerprint) { return absl::StrFormat("%016x", fingerprint); }

std::string FingerprintText(uint64_t fingerprint) {
  return absl::StrFormat("0x%016x (%u)", fingerprint, fingerprint);
}

}  // namespace pdserve::common
