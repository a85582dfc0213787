// The shm-pull data path (docs/protocol.md, "Same-host pages by shared memory"): when a prefill
// and a decode worker run on one host as one user, the decode worker copies each page straight
// out of the prefill worker's page pool instead of receiving it over UCX.
//
// - The decode worker owns an AckTable (a shared region of 64-bit words) and names it in each
//   ticket it issues (ShmPullOffer), with the first of the ticket's words (one per slot).
// - The prefill worker's pages live in a SharedRegion (its page pool's memory). For a ticket with
//   an offer it sends, per page, a kPageRef message instead of a kPage one: the page header,
//   unchanged, then a PageRef naming its region and the page's offset and length there.
// - The decode worker runs every header check of "Verification" first (TransferReceiver, exactly
//   as for a kPage message), then the range check, then copies the page out of the mapped region
//   (PeerRegions) into the destination, checksums the landed bytes, and writes the slot's ack
//   word: (ticket id << 2) | AckState. The prefill worker's page send completes only when that
//   word names the ticket (read through its read-only mapping of the table), or when the decode
//   worker is gone: until then it must not change the page.
//
// Each side maps the other's memory read-only: the decode worker cannot write the prefill's
// pages, the prefill worker cannot write the decode worker's acks.
//
// Thread-safety: AckTable and PeerRegions are safe to call from any thread; PageRef codecs are
// pure functions.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/receive_transport.h"
#include "kvtransfer/shm/shared_memory.h"
#include "kvtransfer/ticket.h"

namespace pdserve::kv::shm {

// memfd purposes (the name's middle part), so a region is never mapped as the other kind.
inline constexpr char kPagesPurpose[] = "pages";
inline constexpr char kAcksPurpose[] = "acks";

enum class AckState : uint64_t {
  kLanded = 1,   // Copied (and checksummed: a mismatch fails the ticket, not the ack).
  kRefused = 2,  // The header was refused (aborted or failed ticket, a check failed): not read.
  kFailed = 3,   // Accepted, but the region could not be mapped or the range is outside it.
};
inline uint64_t AckWord(uint64_t ticket_id, AckState state) {
  return (ticket_id << 2) | static_cast<uint64_t>(state);
}

// The decode worker's ack words, in a SharedRegion the prefill workers map read-only.
class AckTable {
 public:
  // Errors: SharedRegion::Create's, HostBootId's.
  static absl::StatusOr<std::unique_ptr<AckTable>> Create(uint64_t words);
  const RegionName& name() const { return region_->name(); }
  const std::string& boot_id() const { return boot_id_; }
  uint64_t words() const { return region_->bytes().size() / 8; }
  // Takes `count` consecutive words (zeroed) and returns the first one's index, or nullopt when
  // no run of that many is free (the ticket then goes without an offer: active messages).
  std::optional<uint64_t> Reserve(uint64_t count) ABSL_LOCKS_EXCLUDED(mu_);
  void Free(uint64_t index, uint64_t count) ABSL_LOCKS_EXCLUDED(mu_);
  // Stores `word` at `index` with release order (after the copy it acknowledges).
  void Write(uint64_t index, uint64_t word);
  uint64_t Read(uint64_t index) const;

 private:
  AckTable(std::unique_ptr<SharedRegion> region, std::string boot_id)
      : region_(std::move(region)), boot_id_(std::move(boot_id)) {}
  std::atomic<uint64_t>* word(uint64_t index) const;
  const std::unique_ptr<SharedRegion> region_;
  const std::string boot_id_;
  absl::Mutex mu_;
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // first word -> count, coalesced
};

// A prefill worker's GPU page arena as a peer names it (kvtransfer/cuda_ipc/ipc_page_arena.h
// IpcArenaHandle, in plain bytes so this library needs no CUDA): the CUDA IPC handle of the
// driver allocation, where the arena starts in it, its size, its GPU and its host.
struct IpcRegionName {
  std::array<std::byte, 64> memory{};  // cudaIpcMemHandle_t's bytes
  uint64_t allocation_offset = 0;      // the arena's first byte in that allocation
  uint64_t bytes = 0;                  // the arena's size
  std::string pci_bus_id;              // at most 31 characters
  std::string boot_id;                 // at most 39 characters
  bool operator==(const IpcRegionName&) const = default;
};

// Where one page lies in the prefill worker's memory: what a kPageRef message adds to the header.
// `device` set: in its GPU page arena (CUDA IPC; `region` unused), else in its shared-memory
// region.
struct PageRef {
  RegionName region;
  std::optional<IpcRegionName> device;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const PageRef&) const = default;
};

inline constexpr size_t kPageRefBytes = 64;         // After the 64-byte page header.
inline constexpr size_t kDevicePageRefBytes = 192;  // Version 2, after the header.

// A kPageRef message carries the references of one or more pages (docs/protocol.md, "Batched
// references"): each entry an encoded page header followed by its reference, entries back to
// back, each reference's size given by its version. At most MaxRefsPerMessage entries (4 KiB at
// most), which the UCX transport sends eager (UCP_AM_SEND_FLAG_EAGER).
inline size_t MaxRefsPerMessage(bool device) { return device ? 16 : 32; }

// Version 3 (docs/protocol.md, "Compact device-reference batches"): the pages of one GPU arena
// in one message, the arena named once. Layout: the first page's header [64], then the reference
// 0 magic u32 "PDRF"  4 version u16 (3)  6 count u16 (entries, >= 1)  8 CUDA IPC memory handle
// [64]  72 allocation offset u64  80 arena bytes u64  88 PCI bus id [32]  120 boot id [40]
// 160 the first page's offset u64  168 its length u64; then per further page its header [64],
// offset u64, length u64. A receiver that knows only versions 1 and 2 takes the whole message as
// one entry that does not decode: the first page's header check fails (a header error), its
// ticket fails and its sender's transfer with it: loudly, never a page landed by a guess.
inline constexpr uint16_t kDeviceRefBatchVersion = 3;
inline constexpr size_t kDeviceRefBatchFirstBytes = kPageHeaderBytes + 176;
inline constexpr size_t kDeviceRefBatchEntryBytes = kPageHeaderBytes + 16;
// Pages per version-3 message, at most: 240 + 95 * 80 = 7840 bytes, one eager fragment of UCX's
// shared-memory transports (UCX_POSIX_SEG_SIZE / UCX_SYSV_SEG_SIZE 8256 in 1.13) and of tcp's
// 8 KiB segments.
inline constexpr size_t kMaxDeviceRefsPerBatch = 96;

// One page of a version-3 message as the sender writes it.
struct DeviceRefEntry {
  std::array<std::byte, kPageHeaderBytes> header{};
  uint64_t offset = 0;
  uint64_t length = 0;
};
// Appends the version-3 message of `entries` (1 .. kMaxDeviceRefsPerBatch of them, pages of
// `arena`) to `out`.
void AppendDeviceRefBatch(const IpcRegionName& arena, std::span<const DeviceRefEntry> entries,
                          std::vector<std::byte>& out);

// A kPageRef message taken apart (ParsePageRefs): per page its header and its reference, or why
// the reference does not decode (then `header` is the message's bytes at that point, at most 64,
// and the sink refuses the page: it is given length 0, which no ticket's page has).
struct ParsedRef {
  std::span<const std::byte> header;
  absl::Status error;
  const IpcRegionName* arena = nullptr;  // A page in a GPU arena: ParsedRefs::arenas' element.
  RegionName region;                     // Else a page in a shared-memory region.
  uint64_t offset = 0;
  uint64_t length = 0;
};
struct ParsedRefs {
  std::deque<IpcRegionName> arenas;  // One per version-3 message or version-2 entry.
  std::vector<ParsedRef> pages;
};
// Every version: version-1 and -2 entries as SplitPageRefs and DecodePageRef take them, a
// version-3 message's pages with its one arena. A version-3 message whose size is not its count's
// is one undecodable entry (all of it refused, nothing guessed). Pure function.
ParsedRefs ParsePageRefs(std::span<const std::byte> message);

// The entries of a kPageRef message, in order (each an encoded header and its reference, for
// DecodePageRef / LandPageRef). An entry whose reference's magic or version is not known, or that
// the message ends inside, is the message's last and holds the rest of it (it then fails to
// decode as one). Empty for an empty message.
std::vector<std::span<const std::byte>> SplitPageRefs(std::span<const std::byte> message);

// One entry of a kPageRef message: the encoded page header followed by the reference.
// Wire layout of the reference, little-endian: 0 magic u32 "PDRF"  4 version u16 (1)
//   6 reserved u16 (0)  8 pid u32  12 fd u32  16 region bytes u64  24 token [16]  40 offset u64
//   48 length u64  56 reserved u64 (0).
// Version 2 (a page in a GPU arena, 192 bytes): 0 magic  4 version u16 (2)  6 reserved u16 (0)
//   8 CUDA IPC memory handle [64]  72 allocation offset u64  80 arena bytes u64  88 PCI bus id
//   [32] (NUL-padded)  120 boot id [40] (NUL-padded)  160 offset u64  168 length u64
//   176 reserved [16] (0).
std::vector<std::byte> EncodePageRefMessage(std::span<const std::byte> page_header,
                                            const PageRef& ref);
// Splits a kPageRef message. Errors: InvalidArgument when its size, magic, version or reserved
// fields are wrong, or a name field is not NUL-terminated (the message is untrusted).
absl::StatusOr<PageRef> DecodePageRef(std::span<const std::byte> message);

// The decode side's mappings of prefill workers' regions (read-only), made on first use and
// cached. A region whose exporter is gone is unmapped at the next miss; a region that failed to
// map gets its error again until `retry_after` has passed, then one more try (a one-off EMFILE or
// ENOMEM does not force active messages until a restart).
class PeerRegions {
 public:
  explicit PeerRegions(std::string purpose = kPagesPurpose, bool writable = false,
                       absl::Duration retry_after = absl::Seconds(10))
      : purpose_(std::move(purpose)), writable_(writable), retry_after_(retry_after) {}
  absl::StatusOr<std::shared_ptr<const PeerRegion>> Get(const RegionName& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t mapped() const ABSL_LOCKS_EXCLUDED(mu_);
  // Mapping attempts made (successful or not), for tests.
  uint64_t attempts() const ABSL_LOCKS_EXCLUDED(mu_);
  // Unmaps the regions whose exporter is gone (a prefill worker that exited and was not replaced:
  // without it, its whole page pool stayed mapped here, and its memory in use, until another
  // region's first page). Users still holding one keep it until they let go.
  void DropGone() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string purpose_;
  const bool writable_;
  const absl::Duration retry_after_;
  mutable absl::Mutex mu_;
  struct Cached {
    RegionName name;
    std::shared_ptr<const PeerRegion> region;  // null when it failed
    absl::Status error;
    absl::Time failed_at;
  };
  std::vector<Cached> cached_ ABSL_GUARDED_BY(mu_);
  uint64_t attempts_ ABSL_GUARDED_BY(mu_) = 0;
  void EraseGone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

// The decode side's landing of pages that lie in a peer's GPU arena (PageRef::device) into
// device destinations (LandingTarget::device): Add queues one page's copy, Flush runs every
// queued copy with the XXH3-64 of the landed bytes (kvtransfer/cuda_ipc/cuda_page_lander.h: one
// copy launch and one checksum launch for the batch, then one wait) and reports each page. A
// receive transport keeps one per lane and flushes it when the lane has no more messages to
// deliver at once, so a layer's pages land in a few launches, not one wait per page.
//
// Thread-safety: one thread at a time (a lane's).
class DevicePageLander {
 public:
  virtual ~DevicePageLander() = default;
  // Queues the copy of `ref`'s page into `target.destination`. Unavailable "cuda ipc: ..." (and
  // nothing queued) when the arena cannot be mapped here or the page's range lies outside it;
  // InvalidArgument when `ref` names no GPU arena, the target is not device memory or the sizes
  // differ.
  virtual absl::Status Add(const PageRef& ref, const LandingTarget& target) = 0;
  // Add for a page of `arena` at [offset, offset + length), without a PageRef (a version-3
  // message names its arena once for all its pages; a lander may keep the last arena it mapped).
  // Same contract as Add.
  virtual absl::Status AddFromArena(const IpcRegionName& arena, uint64_t offset, uint64_t length,
                                    const LandingTarget& target) {
    return Add(PageRef{.device = arena, .offset = offset, .length = length}, target);
  }
  // Lands every queued page and calls `landed(target, status, xxh3)` for each, in the order they
  // were added: status OK with the landed bytes' XXH3-64, or the copy's error (xxh3 then 0).
  virtual void Flush(
      const std::function<void(const LandingTarget&, absl::Status, uint64_t)>& landed) = 0;
  // Pages queued and not yet flushed.
  virtual size_t pending() const = 0;
};

// Lands the pages of a kPageRef message (each entry of SplitPageRefs, or a whole message of any
// version: ParsePageRefs) for a receive transport, one page after another: `on_header` (the
// sink's OnPageHeader, the page header and the referenced length) decides first. A page in a
// shared-memory region is then copied out of it (mapped through `regions`) into the target,
// FinishLanding runs, and `on_landed` gets the result: OK, or Unavailable "shm pull: ..." when the
// region cannot be mapped or the range lies outside it (nothing copied). A page in a GPU arena goes
// to `lander` (its on_landed comes from the lander's Flush), or fails its landing (Unavailable
// "cuda ipc:
// ...") when there is no lander, the target is host memory or the lander refuses it; a
// shared-memory page for a device target fails the same way. A message whose reference does
// not decode goes to `on_header` with length 0, which no ticket's page has (a header error, not
// a guess). Returns the bytes copied or queued (0 when none).
size_t LandPageRef(PeerRegions& regions, std::span<const std::byte> message,
                   const std::function<std::optional<LandingTarget>(std::span<const std::byte>,
                                                                    size_t)>& on_header,
                   const std::function<void(uint64_t, uint32_t, absl::Status, uint64_t)>& on_landed,
                   DevicePageLander* lander = nullptr);

// LandPageRef for every page of a kPageRef message (ParsePageRefs) at once, with the sink's calls
// batched: `on_headers` gets every page's header and referenced length (0 for a reference that
// does not decode) and fills `targets` (one per page, nullopt: refused), e.g. under one hold of
// the sink's mutex; then the pages land as LandPageRef lands them (shared-memory copies and
// FinishLanding on this thread, GPU pages queued on `lander`), and `on_landed` gets what landed
// or failed here (not the lander's pages: its Flush reports them), once, when any did. Returns the
// bytes copied or queued.
struct PageHeaderAt {
  std::span<const std::byte> header;
  size_t length = 0;
};
struct LandedPage {
  uint64_t ticket_id = 0;
  uint32_t slot = 0;
  absl::Status status;
  uint64_t finished = 0;
};
size_t LandPageRefs(
    PeerRegions& regions, std::span<const std::byte> message,
    const std::function<void(std::span<const PageHeaderAt>,
                             std::vector<std::optional<LandingTarget>>& targets)>& on_headers,
    const std::function<void(std::vector<LandedPage>&)>& on_landed,
    DevicePageLander* lander = nullptr);

// The prefill side: its page region and its read-only mappings of decode workers' ack tables.
class PullSender {
 public:
  // `pages` must outlive the sender. Errors: HostBootId's.
  // `disable_for`: how long Disable keeps a decode worker on active messages.
  static absl::StatusOr<std::unique_ptr<PullSender>> Create(
      const SharedRegion& pages, absl::Duration disable_for = absl::Seconds(60));
  const SharedRegion& pages() const { return pages_; }
  // The ack words of `offer`'s ticket (`slots` of them), mapped read-only, or the reason the
  // ticket cannot be pulled (another host, a table that cannot be mapped, words outside it).
  struct Acks {
    std::shared_ptr<const PeerRegion> table;
    const std::atomic<uint64_t>* words = nullptr;  // words[slot]
  };
  absl::StatusOr<Acks> AcksFor(const ShmPullOffer& offer, size_t slots) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops pulling for the decode worker of `acks`' table (it could not read this worker's
  // region): AcksFor answers `why` for `disable_for`, then tries again (a decode worker that
  // still cannot read costs one page sent again as a message, Transfer's fallback).
  void Disable(const RegionName& acks, absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);
  // Decode workers' ack tables mapped now (a gone one's is dropped by the first AcksFor a second
  // or more after the previous drop).
  size_t tables_mapped() const { return tables_.mapped(); }

 private:
  PullSender(const SharedRegion& pages, std::string boot_id, absl::Duration disable_for)
      : pages_(pages),
        boot_id_(std::move(boot_id)),
        disable_for_(disable_for),
        tables_(kAcksPurpose) {}
  struct Disabled {
    RegionName acks;
    absl::Status why;
    absl::Time until;
  };
  const SharedRegion& pages_;
  const std::string boot_id_;
  const absl::Duration disable_for_;
  PeerRegions tables_;
  absl::Mutex mu_;
  std::vector<Disabled> disabled_ ABSL_GUARDED_BY(mu_);
  // When AcksFor next drops the tables of decode workers that are gone (PeerRegions::DropGone).
  absl::Time next_gone_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace pdserve::kv::shm
