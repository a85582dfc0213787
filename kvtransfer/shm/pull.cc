#include "kvtransfer/shm/pull.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvtransfer/page_header.h"

namespace pdserve::kv::shm {
namespace {

constexpr uint32_t kRefMagic = 0x46524450;  // "PDRF" in little-endian byte order.
constexpr uint16_t kRefVersion = 1;
// Mappings kept at most; past it the oldest is dropped at the next miss (its users hold it).
constexpr size_t kMaxCachedRegions = 64;

// Whether the exporter of `name` still holds it: its fd still carries the token's memfd name.
bool StillExported(const std::string& purpose, const RegionName& name) {
  const std::string path = absl::StrCat("/proc/", name.pid, "/fd/", name.fd);
  char link[256] = {};
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n < 0) return false;
  return std::string(link, static_cast<size_t>(n))
             .rfind(absl::StrCat("/memfd:", MemfdName(purpose, name.token)), 0) == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AckTable>> AckTable::Create(uint64_t words) {
  if (words == 0) return absl::InvalidArgumentError("AckTable: 0 words");
  absl::StatusOr<std::string> boot = HostBootId();
  if (!boot.ok()) return boot.status();
  auto region = SharedRegion::Create(kAcksPurpose, words * 8);
  if (!region.ok()) return region.status();
  std::unique_ptr<AckTable> table(new AckTable(std::move(*region), std::move(*boot)));
  absl::MutexLock lock(&table->mu_);
  table->free_[0] = words;
  return table;
}

std::atomic<uint64_t>* AckTable::word(uint64_t index) const {
  static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free);
  return reinterpret_cast<std::atomic<uint64_t>*>(region_->bytes().data()) + index;
}

std::optional<uint64_t> AckTable::Reserve(uint64_t count) {
  if (count == 0) return std::nullopt;
  absl::MutexLock lock(&mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < count) continue;
    const uint64_t index = it->first;
    const uint64_t left = it->second - count;
    free_.erase(it);
    if (left > 0) free_[index + count] = left;
    for (uint64_t i = 0; i < count; ++i) word(index + i)->store(0, std::memory_order_relaxed);
    return index;
  }
  return std::nullopt;
}

void AckTable::Free(uint64_t index, uint64_t count) {
  if (count == 0) return;
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = free_.emplace(index, count);
  if (!inserted) return;  // Freed twice: keep the table consistent.
  if (auto next = std::next(it); next != free_.end() && index + count == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

void AckTable::Write(uint64_t index, uint64_t value) {
  if (index < words()) word(index)->store(value, std::memory_order_release);
}

uint64_t AckTable::Read(uint64_t index) const {
  return index < words() ? word(index)->load(std::memory_order_acquire) : 0;
}

namespace {

constexpr uint16_t kDeviceRefVersion = 2;
constexpr size_t kBusIdField = 32;
constexpr size_t kBootIdField = 40;

// `text` into a NUL-padded field of `size` bytes at `at` (cut to size - 1 bytes).
void StoreName(std::span<std::byte> r, size_t at, const std::string& text, size_t size) {
  std::memcpy(r.data() + at, text.data(), std::min(text.size(), size - 1));
}

// The text of a NUL-padded field; nullopt when it has no NUL or bytes other than NUL after it
// (an untrusted field: what decodes must encode to the same bytes).
std::optional<std::string> LoadName(std::span<const std::byte> r, size_t at, size_t size) {
  const char* p = reinterpret_cast<const char*>(r.data() + at);
  const size_t n = strnlen(p, size);
  if (n == size) return std::nullopt;
  for (size_t i = n; i < size; ++i) {
    if (p[i] != '\0') return std::nullopt;
  }
  return std::string(p, n);
}

void StoreArena(std::span<std::byte> r, const IpcRegionName& d) {
  std::memcpy(r.data() + 8, d.memory.data(), d.memory.size());
  StoreLe(r, 72, d.allocation_offset, 8);
  StoreLe(r, 80, d.bytes, 8);
  StoreName(r, 88, d.pci_bus_id, kBusIdField);
  StoreName(r, 120, d.boot_id, kBootIdField);
}

// The arena of a version-2 or -3 reference `r`; nullopt when a name field lacks its NUL.
std::optional<IpcRegionName> LoadArena(std::span<const std::byte> r) {
  IpcRegionName d;
  std::memcpy(d.memory.data(), r.data() + 8, d.memory.size());
  d.allocation_offset = LoadLe(r, 72, 8);
  d.bytes = LoadLe(r, 80, 8);
  std::optional<std::string> bus = LoadName(r, 88, kBusIdField);
  std::optional<std::string> boot = LoadName(r, 120, kBootIdField);
  if (!bus.has_value() || !boot.has_value()) return std::nullopt;
  d.pci_bus_id = std::move(*bus);
  d.boot_id = std::move(*boot);
  return d;
}

}  // namespace

std::vector<std::byte> EncodePageRefMessage(std::span<const std::byte> page_header,
                                            const PageRef& ref) {
  const size_t ref_bytes = ref.device.has_value() ? kDevicePageRefBytes : kPageRefBytes;
  std::vector<std::byte> out(page_header.size() + ref_bytes);
  std::memcpy(out.data(), page_header.data(), page_header.size());
  const std::span<std::byte> r = std::span(out).subspan(page_header.size());
  StoreLe(r, 0, kRefMagic, 4);
  if (ref.device.has_value()) {
    StoreLe(r, 4, kDeviceRefVersion, 2);
    StoreArena(r, *ref.device);
    StoreLe(r, 160, ref.offset, 8);
    StoreLe(r, 168, ref.length, 8);
    return out;
  }
  StoreLe(r, 4, kRefVersion, 2);
  StoreLe(r, 8, ref.region.pid, 4);
  StoreLe(r, 12, ref.region.fd, 4);
  StoreLe(r, 16, ref.region.bytes, 8);
  std::memcpy(r.data() + 24, ref.region.token.data(), ref.region.token.size());
  StoreLe(r, 40, ref.offset, 8);
  StoreLe(r, 48, ref.length, 8);
  return out;
}

std::vector<std::span<const std::byte>> SplitPageRefs(std::span<const std::byte> message) {
  std::vector<std::span<const std::byte>> entries;
  size_t at = 0;
  while (at < message.size()) {
    const std::span<const std::byte> rest = message.subspan(at);
    size_t size = rest.size();  // An entry of unknown shape takes the rest.
    if (rest.size() >= kPageHeaderBytes + 8 && LoadLe(rest, kPageHeaderBytes, 4) == kRefMagic) {
      const uint64_t version = LoadLe(rest, kPageHeaderBytes + 4, 2);
      const size_t ref = version == kRefVersion         ? kPageRefBytes
                         : version == kDeviceRefVersion ? kDevicePageRefBytes
                                                        : rest.size();
      size = std::min(rest.size(), kPageHeaderBytes + ref);
    }
    entries.push_back(rest.first(size));
    at += size;
  }
  return entries;
}

absl::StatusOr<PageRef> DecodePageRef(std::span<const std::byte> message) {
  const bool device = message.size() == kPageHeaderBytes + kDevicePageRefBytes;
  if (message.size() != kPageHeaderBytes + kPageRefBytes && !device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page reference message of ", message.size(), " bytes, expected ",
        kPageHeaderBytes + kPageRefBytes, " or ", kPageHeaderBytes + kDevicePageRefBytes));
  }
  const std::span<const std::byte> r = message.subspan(kPageHeaderBytes);
  if (LoadLe(r, 0, 4) != kRefMagic ||
      LoadLe(r, 4, 2) != (device ? kDeviceRefVersion : kRefVersion) || LoadLe(r, 6, 2) != 0 ||
      (device ? LoadLe(r, 176, 8) != 0 || LoadLe(r, 184, 8) != 0 : LoadLe(r, 56, 8) != 0)) {
    return absl::InvalidArgumentError("page reference: bad magic, version or reserved field");
  }
  PageRef ref;
  if (device) {
    std::optional<IpcRegionName> d = LoadArena(r);
    if (!d.has_value()) {
      return absl::InvalidArgumentError("page reference: a name field without its NUL");
    }
    ref.device = std::move(*d);
    ref.offset = LoadLe(r, 160, 8);
    ref.length = LoadLe(r, 168, 8);
    return ref;
  }
  ref.region.pid = static_cast<uint32_t>(LoadLe(r, 8, 4));
  ref.region.fd = static_cast<uint32_t>(LoadLe(r, 12, 4));
  ref.region.bytes = LoadLe(r, 16, 8);
  std::memcpy(ref.region.token.data(), r.data() + 24, ref.region.token.size());
  ref.offset = LoadLe(r, 40, 8);
  ref.length = LoadLe(r, 48, 8);
  return ref;
}

namespace {

// The pages of a version-3 message (`message` starts with its first page's header); false when
// it is not one whole well-formed message.
bool ParseDeviceBatch(std::span<const std::byte> message, ParsedRefs& out) {
  if (message.size() < kDeviceRefBatchFirstBytes) return false;
  const std::span<const std::byte> r = message.subspan(kPageHeaderBytes);
  const uint64_t count = LoadLe(r, 6, 2);
  if (count == 0 || count > kMaxDeviceRefsPerBatch ||
      message.size() != kDeviceRefBatchFirstBytes + (count - 1) * kDeviceRefBatchEntryBytes) {
    return false;
  }
  std::optional<IpcRegionName> arena = LoadArena(r);
  if (!arena.has_value()) return false;
  const IpcRegionName* named = &out.arenas.emplace_back(std::move(*arena));
  out.pages.push_back({.header = message.first(kPageHeaderBytes),
                       .arena = named,
                       .offset = LoadLe(r, 160, 8),
                       .length = LoadLe(r, 168, 8)});
  for (size_t at = kDeviceRefBatchFirstBytes; at < message.size();
       at += kDeviceRefBatchEntryBytes) {
    const std::span<const std::byte> e = message.subspan(at, kDeviceRefBatchEntryBytes);
    out.pages.push_back({.header = e.first(kPageHeaderBytes),
                         .arena = named,
                         .offset = LoadLe(e, kPageHeaderBytes, 8),
                         .length = LoadLe(e, kPageHeaderBytes + 8, 8)});
  }
  return true;
}

}  // namespace

void AppendDeviceRefBatch(const IpcRegionName& arena, std::span<const DeviceRefEntry> entries,
                          std::vector<std::byte>& out) {
  if (entries.empty()) return;
  const size_t at = out.size();
  out.resize(at + kDeviceRefBatchFirstBytes + (entries.size() - 1) * kDeviceRefBatchEntryBytes);
  const std::span<std::byte> m = std::span(out).subspan(at);
  std::memcpy(m.data(), entries[0].header.data(), kPageHeaderBytes);
  const std::span<std::byte> r = m.subspan(kPageHeaderBytes);
  StoreLe(r, 0, kRefMagic, 4);
  StoreLe(r, 4, kDeviceRefBatchVersion, 2);
  StoreLe(r, 6, entries.size(), 2);
  StoreArena(r, arena);
  StoreLe(r, 160, entries[0].offset, 8);
  StoreLe(r, 168, entries[0].length, 8);
  size_t e = kDeviceRefBatchFirstBytes;
  for (size_t i = 1; i < entries.size(); ++i, e += kDeviceRefBatchEntryBytes) {
    std::memcpy(m.data() + e, entries[i].header.data(), kPageHeaderBytes);
    StoreLe(m, e + kPageHeaderBytes, entries[i].offset, 8);
    StoreLe(m, e + kPageHeaderBytes + 8, entries[i].length, 8);
  }
}

ParsedRefs ParsePageRefs(std::span<const std::byte> message) {
  ParsedRefs out;
  for (std::span<const std::byte> entry : SplitPageRefs(message)) {
    if (entry.size() >= kPageHeaderBytes + 8 && LoadLe(entry, kPageHeaderBytes, 4) == kRefMagic &&
        LoadLe(entry, kPageHeaderBytes + 4, 2) == kDeviceRefBatchVersion) {
      if (ParseDeviceBatch(entry, out)) continue;
      out.pages.push_back(
          {.header = entry.first(kPageHeaderBytes),
           .error = absl::InvalidArgumentError("page reference: a malformed version-3 batch")});
      continue;
    }
    absl::StatusOr<PageRef> ref = DecodePageRef(entry);
    ParsedRef page{.header = entry.first(std::min(entry.size(), kPageHeaderBytes))};
    if (!ref.ok()) {
      page.error = ref.status();
    } else {
      if (ref->device.has_value()) page.arena = &out.arenas.emplace_back(std::move(*ref->device));
      page.region = ref->region;
      page.offset = ref->offset;
      page.length = ref->length;
    }
    out.pages.push_back(std::move(page));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const PeerRegion>> PeerRegions::Get(const RegionName& name) {
  absl::MutexLock lock(&mu_);
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    if (it->name != name) continue;
    if (it->region != nullptr) return it->region;
    if (absl::Now() - it->failed_at < retry_after_) return it->error;
    cached_.erase(it);  // Time for another try.
    break;
  }
  // A miss: drop mappings of exporters that are gone (a restarted prefill worker's old pool),
  // then the oldest while over the cap.
  EraseGone();
  while (cached_.size() >= kMaxCachedRegions) cached_.erase(cached_.begin());
  ++attempts_;
  absl::StatusOr<std::unique_ptr<PeerRegion>> mapped = PeerRegion::Map(purpose_, name, writable_);
  if (!mapped.ok()) {
    cached_.push_back({name, nullptr, mapped.status(), absl::Now()});
    return mapped.status();
  }
  std::shared_ptr<const PeerRegion> region = std::move(*mapped);
  cached_.push_back({name, region, absl::OkStatus(), absl::InfinitePast()});
  return region;
}

uint64_t PeerRegions::attempts() const {
  absl::MutexLock lock(&mu_);
  return attempts_;
}

void PeerRegions::EraseGone() {
  std::erase_if(cached_, [&](const Cached& c) { return !StillExported(purpose_, c.name); });
}

void PeerRegions::DropGone() {
  absl::MutexLock lock(&mu_);
  EraseGone();
}

size_t PeerRegions::mapped() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const Cached& cached : cached_) n += cached.region != nullptr ? 1 : 0;
  return n;
}

namespace {

// Lands one page whose header the sink accepted (`target`): a GPU-arena page is queued on
// `lander`, a shared-memory page copied and finished here; what is over here goes to `landed`.
// Returns the bytes copied or queued.
size_t LandAccepted(PeerRegions& regions, const ParsedRef& page, const LandingTarget& target,
                    DevicePageLander* lander, std::vector<LandedPage>& landed) {
  auto fail = [&](absl::Status status) {
    landed.push_back({target.ticket_id, target.slot, std::move(status), 0});
    return size_t{0};
  };
  if (!page.error.ok()) {  // Unreachable unless a page of 0 bytes existed: fail it, copy nothing.
    return fail(absl::UnavailableError("shm pull: bad reference"));
  }
  if (page.arena != nullptr || target.device) {
    absl::Status queued;
    if (page.arena == nullptr) {
      queued = absl::UnavailableError(
          "cuda ipc: a page in shared memory cannot land in this worker's GPU pages");
    } else if (!target.device) {
      queued = absl::UnavailableError("cuda ipc: a page in a GPU arena for host pages");
    } else if (lander == nullptr) {
      queued = absl::UnavailableError("cuda ipc: this worker does not land GPU pages");
    } else {
      queued = lander->AddFromArena(*page.arena, page.offset, page.length, target);
    }
    if (!queued.ok()) {
      return fail(queued.code() == absl::StatusCode::kUnavailable
                      ? std::move(queued)
                      : absl::UnavailableError(absl::StrCat("cuda ipc: ", queued.message())));
    }
    return page.length;
  }
  absl::StatusOr<std::shared_ptr<const PeerRegion>> region = regions.Get(page.region);
  if (!region.ok()) {
    return fail(absl::UnavailableError(absl::StrCat("shm pull: ", region.status().message())));
  }
  if (!(*region)->InRange(page.offset, page.length) || page.length != target.destination.size()) {
    return fail(absl::UnavailableError(
        absl::StrCat("shm pull: page [", page.offset, ", +", page.length, ") lies outside the ",
                     (*region)->bytes().size(), "-byte region of process ", page.region.pid)));
  }
  std::memcpy(target.destination.data(), (*region)->bytes().data() + page.offset, page.length);
  landed.push_back({target.ticket_id, target.slot, absl::OkStatus(), FinishLanding(target)});
  return page.length;
}

}  // namespace

size_t LandPageRefs(
    PeerRegions& regions, std::span<const std::byte> message,
    const std::function<void(std::span<const PageHeaderAt>,
                             std::vector<std::optional<LandingTarget>>& targets)>& on_headers,
    const std::function<void(std::vector<LandedPage>&)>& on_landed, DevicePageLander* lander) {
  const ParsedRefs parsed = ParsePageRefs(message);
  std::vector<PageHeaderAt> headers;
  headers.reserve(parsed.pages.size());
  for (const ParsedRef& page : parsed.pages) {
    headers.push_back({page.header, page.error.ok() ? static_cast<size_t>(page.length) : 0});
  }
  std::vector<std::optional<LandingTarget>> targets(headers.size());
  on_headers(headers, targets);
  std::vector<LandedPage> landed;
  size_t bytes = 0;
  for (size_t i = 0; i < parsed.pages.size(); ++i) {
    if (targets[i].has_value())
      bytes += LandAccepted(regions, parsed.pages[i], *targets[i], lander, landed);
  }
  if (!landed.empty()) on_landed(landed);
  return bytes;
}

size_t LandPageRef(PeerRegions& regions, std::span<const std::byte> message,
                   const std::function<std::optional<LandingTarget>(std::span<const std::byte>,
                                                                    size_t)>& on_header,
                   const std::function<void(uint64_t, uint32_t, absl::Status, uint64_t)>& on_landed,
                   DevicePageLander* lander) {
  return LandPageRefs(
      regions, message,
      [&](std::span<const PageHeaderAt> headers,
          std::vector<std::optional<LandingTarget>>& targets) {
        for (size_t i = 0; i < headers.size(); ++i) {
          targets[i] = on_header(headers[i].header, headers[i].length);
        }
      },
      [&](std::vector<LandedPage>& landed) {
        for (LandedPage& page : landed) {
          on_landed(page.ticket_id, page.slot, std::move(page.status), page.finished);
        }
      },
      lander);
}

absl::StatusOr<std::unique_ptr<PullSender>> PullSender::Create(const SharedRegion& pages,
                                                               absl::Duration disable_for) {
  absl::StatusOr<std::string> boot = HostBootId();
  if (!boot.ok()) return boot.status();
  return std::unique_ptr<PullSender>(new PullSender(pages, std::move(*boot), disable_for));
}

absl::StatusOr<PullSender::Acks> PullSender::AcksFor(const ShmPullOffer& offer, size_t slots) {
  if (offer.boot_id != boot_id_) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm pull: the decode worker runs on another host (boot id ", offer.boot_id,
                     ", here ", boot_id_, ")"));
  }
  bool check_gone = false;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    std::erase_if(disabled_, [&](const Disabled& d) { return d.until <= now; });
    for (const Disabled& d : disabled_) {
      if (d.acks == offer.acks) return d.why;
    }
    // At most once a second: unmap the ack tables of decode workers that are gone.
    if (now >= next_gone_check_) {
      next_gone_check_ = now + absl::Seconds(1);
      check_gone = true;
    }
  }
  if (check_gone) tables_.DropGone();
  absl::StatusOr<std::shared_ptr<const PeerRegion>> table = tables_.Get(offer.acks);
  if (!table.ok()) return table.status();
  const uint64_t words = (*table)->bytes().size() / 8;
  if (offer.ack_index > words || slots > words - offer.ack_index) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm pull: ack words [", offer.ack_index, ", +", slots,
                     ") lie outside the decode worker's table of ", words));
  }
  const auto* base = reinterpret_cast<const std::atomic<uint64_t>*>((*table)->bytes().data());
  return Acks{*table, base + offer.ack_index};
}

void PullSender::Disable(const RegionName& acks, absl::Status why) {
  absl::MutexLock lock(&mu_);
  for (const Disabled& d : disabled_) {
    if (d.acks == acks) return;
  }
  if (disabled_.size() >= 256) disabled_.erase(disabled_.begin());
  disabled_.push_back({acks, std::move(why), absl::Now() + disable_for_});
}

}  // namespace pdserve::kv::shm
