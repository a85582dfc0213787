#include "common/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace pdserve::common {
namespace {

std::string_view Trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\r\n\f\v";
  const size_t begin = s.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  return s.substr(begin, s.find_last_not_of(kSpace) - begin + 1);
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

}  // namespace

ApiKeys::Digest ApiKeys::Hash(std::string_view key) {
  Digest digest;
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), digest.data());
  return digest;
}

absl::StatusOr<std::shared_ptr<const ApiKeys>> ApiKeys::FromText(std::string_view text,
                                                                 const std::string& source) {
  std::vector<Digest> digests;
  int line_number = 0;
  while (!text.empty()) {
    const size_t end = text.find('\n');
    std::string_view line = Trim(text.substr(0, end));
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
    ++line_number;
    if (line.empty() || line.front() == '#') continue;
    for (char c : line) {
      const auto u = static_cast<unsigned char>(c);
      if (u <= 0x20 || u == 0x7f) {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ":", line_number, ": an API key may not hold spaces or control characters"));
      }
    }
    digests.push_back(Hash(line));
  }
  if (digests.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no API key in the file (one key per line; '#' starts a comment)"));
  }
  return std::shared_ptr<const ApiKeys>(new ApiKeys(std::move(digests)));
}

absl::StatusOr<std::shared_ptr<const ApiKeys>> ApiKeys::LoadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the API key file"));
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str(), path);
}

bool ApiKeys::Matches(std::string_view authorization) const {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size() ||
      !EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  const Digest presented = Hash(Trim(authorization.substr(kScheme.size())));
  // Every digest is compared, whatever matched first.
  int matched = 0;
  for (const Digest& digest : digests_) {
    matched |= CRYPTO_memcmp(presented.data(), digest.data(), digest.size()) == 0;
  }
  return matched != 0;
}

}  // namespace pdserve::common
