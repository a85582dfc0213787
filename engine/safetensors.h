// Read-only access to one safetensors file: the JSON header is parsed with nlohmann-json and the
// tensor bytes stay in a private read-only mmap of the file.
//
// Format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian header
// length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
// "__metadata__": {str: str}}, then the data section; offsets are relative to the data section.
// Every entry is checked before any byte is read: a known dtype, non-negative dims, begin <= end
// inside the data section, and end - begin equal to the element count times the element size
// (with overflow checks). Errors name the file and the tensor; nothing here aborts or throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::engine {

// Element types a safetensors header may name. kF4 is the packed FP4 (E2M1) type newer
// safetensors writes for torch.float4_e2m1fn_x2: two elements per byte, shape counts elements.
enum class DType {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kF8E8M0,
  kF4,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kI64,
  kU64,
  kF64,
};

// The header spelling ("BF16", "F8_E4M3", ...), and back (std::nullopt for unknown names).
const char* DTypeName(DType t);
std::optional<DType> DTypeFromName(std::string_view name);
// Size in bits of one element (4 for kF4, 8 for the one-byte types, ...).
int DTypeBits(DType t);
bool IsIntegerDType(DType t);

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section, [begin, end)
  uint64_t end = 0;
  int64_t NumElements() const;
  std::string ShapeString() const;  // "[4, 64]"
};

struct SafetensorsLayout {
  std::vector<TensorInfo> tensors;  // in header order
  uint64_t data_offset = 0;         // file offset of the data section (8 + header length)
};

// Parses and validates the header of a whole safetensors file held in `file`. `source` names the
// file in errors. Does not read tensor data. Safe on arbitrary bytes (fuzzed: see
// tests/engine_loader/safetensors_header_fuzzer.cc).
absl::StatusOr<SafetensorsLayout> ParseSafetensors(std::span<const uint8_t> file,
                                                   const std::string& source);

// One tensor to write: `bytes` holds the little-endian elements (two F4 elements per byte).
struct TensorBytes {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string_view bytes;
};

// Writes a safetensors file (header padded to 8 bytes, "__metadata__": {"format": "pt"}, data in
// the given order). InvalidArgument when a tensor's byte count does not match its dtype and
// shape; Internal on I/O errors. Used by tests, benchmarks and tools that produce checkpoints.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorBytes>& tensors);

// One opened, mmapped safetensors file. Move-only; unmaps on destruction. Concurrent reads of
// the tensors and their bytes are safe.
class SafetensorsFile {
 public:
  // NotFound when `path` does not exist; InvalidArgument / DataLoss for a malformed header or a
  // data section shorter than the header claims; both name `path`.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return layout_.tensors; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* Find(std::string_view name) const;
  // The tensor's bytes inside the mapping (bounds were checked by Open). Unaligned.
  std::span<const uint8_t> Bytes(const TensorInfo& info) const;
  // Drops the mapped pages that lie wholly inside the tensor's bytes from this process
  // (madvise MADV_DONTNEED; a later Bytes() read maps them from the file again), so a loader
  // that has copied a tensor elsewhere does not keep it resident. Pages shared with a
  // neighbouring tensor stay. Safe while other threads read other tensors.
  void Release(const TensorInfo& info) const;

 private:
  SafetensorsFile() = default;
  void Unmap();

  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  SafetensorsLayout layout_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in layout_.tensors
};

}  // namespace pdserve::engine
