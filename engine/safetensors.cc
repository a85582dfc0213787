#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

using Json = nlohmann::json;

struct DTypeEntry {
  DType type;
  const char* name;
  int bits;
  bool integer;
};

constexpr std::array<DTypeEntry, 17> kDTypes = {{
    {DType::kBool, "BOOL", 8, true},
    {DType::kU8, "U8", 8, true},
    {DType::kI8, "I8", 8, true},
    {DType::kF8E5M2, "F8_E5M2", 8, false},
    {DType::kF8E4M3, "F8_E4M3", 8, false},
    {DType::kF8E8M0, "F8_E8M0", 8, false},
    {DType::kF4, "F4", 4, false},
    {DType::kI16, "I16", 16, true},
    {DType::kU16, "U16", 16, true},
    {DType::kF16, "F16", 16, false},
    {DType::kBF16, "BF16", 16, false},
    {DType::kI32, "I32", 32, true},
    {DType::kU32, "U32", 32, true},
    {DType::kF32, "F32", 32, false},
    {DType::kI64, "I64", 64, true},
    {DType::kU64, "U64", 64, true},
    {DType::kF64, "F64", 64, false},
}};

const DTypeEntry& Entry(DType t) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.type == t) return e;
  }
  return kDTypes[0];  // unreachable: every enumerator has an entry
}

// Longest header accepted; the safetensors reference implementation uses the same 100 MB cap.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

absl::Status HeaderError(const std::string& source, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": bad safetensors header: ", what));
}

absl::StatusOr<TensorInfo> ParseEntry(const std::string& name, const Json& entry,
                                      uint64_t data_size, const std::string& source) {
  const std::string where = absl::StrCat("tensor \"", name, "\"");
  if (!entry.is_object()) return HeaderError(source, absl::StrCat(where, " is not an object"));
  TensorInfo info;
  info.name = name;

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return HeaderError(source, absl::StrCat(where, " has no dtype string"));
  }
  const std::string dtype = dtype_it->get<std::string>();
  const std::optional<DType> type = DTypeFromName(dtype);
  if (!type) return HeaderError(source, absl::StrCat(where, " has unknown dtype \"", dtype, "\""));
  info.dtype = *type;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return HeaderError(source, absl::StrCat(where, " has no shape list"));
  }
  // Element count and bit count with overflow checks.
  uint64_t elements = 1;
  for (const Json& d : *shape_it) {
    if (!d.is_number_unsigned()) {
      return HeaderError(source, absl::StrCat(where,
                                              " has a shape entry that is not a "
                                              "non-negative integer: ",
                                              d.dump()));
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return HeaderError(source, absl::StrCat(where, " has a dimension too large"));
    }
    if (__builtin_mul_overflow(elements, dim, &elements)) {
      return HeaderError(source, absl::StrCat(where, " has too many elements"));
    }
    info.shape.push_back(static_cast<int64_t>(dim));
  }

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
    return HeaderError(source, absl::StrCat(where, " needs data_offsets [begin, end]"));
  }
  info.begin = (*offsets_it)[0].get<uint64_t>();
  info.end = (*offsets_it)[1].get<uint64_t>();
  if (info.begin > info.end) {
    return HeaderError(source, absl::StrCat(where, " has data_offsets begin ", info.begin,
                                            " after end ", info.end));
  }
  uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, static_cast<uint64_t>(Entry(info.dtype).bits), &bits)) {
    return HeaderError(source, absl::StrCat(where, " has too many elements"));
  }
  if (bits % 8 != 0 || bits / 8 != info.end - info.begin) {
    return HeaderError(source, absl::StrCat(where, " holds ", info.end - info.begin, " bytes but ",
                                            dtype, " ", info.ShapeString(), " needs ", bits / 8,
                                            bits % 8 ? " and a half" : ""));
  }
  if (info.end > data_size) {
    return absl::DataLossError(absl::StrCat(
        source, ": tensor \"", name, "\": data_offsets [", info.begin, ", ", info.end,
        ") run past the end of the data section (", data_size, " bytes): file truncated"));
  }
  return info;
}

}  // namespace

const char* DTypeName(DType t) { return Entry(t).name; }

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (name == e.name) return e.type;
  }
  return std::nullopt;
}
int DTypeBits(DType t) { return Entry(t).bits; }
bool IsIntegerDType(DType t) { return Entry(t).integer; }

int64_t TensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<SafetensorsLayout> ParseSafetensors(std::span<const uint8_t> file,
                                                   const std::string& source) {
  if (file.size() < 8) {
    return HeaderError(source, absl::StrCat("file is ", file.size(),
                                            " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file[static_cast<size_t>(i)];
  if (header_len > kMaxHeaderBytes) {
    return HeaderError(
        source, absl::StrCat("header length ", header_len, " exceeds ", kMaxHeaderBytes, " bytes"));
  }
  if (header_len > file.size() - 8) {
    return absl::DataLossError(absl::StrCat(source, ": bad safetensors header: header length ",
                                            header_len, " exceeds the file (", file.size(),
                                            " bytes): file truncated"));
  }
  const auto* text = reinterpret_cast<const char*>(file.data() + 8);
  const Json header = Json::parse(text, text + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return HeaderError(source, "header is not valid JSON");
  if (!header.is_object()) return HeaderError(source, "header is not a JSON object");

  SafetensorsLayout layout;
  layout.data_offset = 8 + header_len;
  const uint64_t data_size = file.size() - layout.data_offset;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return HeaderError(source, "__metadata__ is not an object");
      continue;
    }
    auto info = ParseEntry(it.key(), it.value(), data_size, source);
    if (!info.ok()) return info.status();
    layout.tensors.push_back(*std::move(info));
  }
  return layout;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorBytes>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const TensorBytes& t : tensors) {
    uint64_t bits = static_cast<uint64_t>(Entry(t.dtype).bits);
    for (int64_t d : t.shape) bits *= static_cast<uint64_t>(d);
    if (bits % 8 != 0 || bits / 8 != t.bytes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", t.name, "\": ", t.bytes.size(), " bytes do not fit ",
                       DTypeName(t.dtype), " ", absl::StrJoin(t.shape, ", ")));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorBytes& t : tensors) {
    out.write(t.bytes.data(), static_cast<std::streamsize>(t.bytes.size()));
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  SafetensorsFile file;
  file.path_ = path;
  file.map_size_ = static_cast<size_t>(st.st_size);
  if (file.map_size_ > 0) {
    void* map = ::mmap(nullptr, file.map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
    file.map_ = static_cast<const uint8_t*>(map);
  }
  ::close(fd);  // the mapping keeps the file alive
  auto layout = ParseSafetensors(std::span<const uint8_t>(file.map_, file.map_size_), path);
  if (!layout.ok()) return layout.status();
  file.layout_ = *std::move(layout);
  for (size_t i = 0; i < file.layout_.tensors.size(); ++i) {
    file.index_.emplace(file.layout_.tensors[i].name, i);
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      layout_(std::move(other.layout_)),
      index_(std::move(other.index_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    layout_ = std::move(other.layout_);
    index_ = std::move(other.index_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &layout_.tensors[it->second];
}

std::span<const uint8_t> SafetensorsFile::Bytes(const TensorInfo& info) const {
  return {map_ + layout_.data_offset + info.begin, static_cast<size_t>(info.end - info.begin)};
}

void SafetensorsFile::Release(const TensorInfo& info) const {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(Bytes(info).data());
  const uintptr_t end = begin + (info.end - info.begin);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = end / page * page;
  if (last <= first) return;
  // Advice only: a failure leaves the pages resident, which costs memory, not correctness.
  ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace pdserve::engine
