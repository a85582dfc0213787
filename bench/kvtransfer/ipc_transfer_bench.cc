// Same-host device-to-device state pages through CUDA IPC (kvtransfer/cuda_ipc), two processes
// on one GPU: the building blocks of docs/protocol.md's "Same-host device-to-device pages (CUDA
// IPC), design", measured. Not the product path (nothing here goes through TransferSender /
// TransferReceiver).
//
// The prefill process P (the parent) owns an IpcPageArena for one prompt's state pages: 8 layers
// at V4-Flash attention shapes (CSA rate 4 / HCA rate 128 alternating; per layer a 128-entry
// window page, 64-entry pages of 512-dim compressed entries, for CSA 64-entry pages of 128-dim
// indexer keys, and the compressor's buffers: an approximation of the state
// gpu_state_transfer_bench moves, bf16, random bytes). The decode process D (a child forked
// before CUDA starts) opens the arena once (PeerArena). Per prompt length and repeat, P times,
// on its clock:
//   t0: P exports: gathers every page from its slot buffer (random bytes, pages in another order)
//       into the arena (kernels/cuda/page_copy.cuh, one launch) and checksums them on the GPU
//       (kernels/cuda/xxh3.cuh, one launch), then sends the descriptors (page id, arena offset,
//       length, checksum) over a Unix socket;
//   D: copies every page device-to-device from P's arena into its own pages (a shuffled page
//       table in one pool; --copy kernel, the default: one kernels/cuda/page_copy.cuh launch;
//       memcpy: one cudaMemcpyAsync per page; batch: one cudaMemcpyBatchAsync), checksums its
//       pages on the GPU, compares, answers the number of mismatched pages;
//   t1: P has the answer. e2e GB/s = bytes / (t1 - t0).
// D also reports its own share (descriptors in -> verdict out) and, separately timed, the copy
// alone and the checksum alone. Floors of the same bytes in D, same run: (a) cudaMemcpy device ->
// pinned host -> device (GB/s = bytes / (D2H + H2D time)); (d2d) one cudaMemcpy device -> device
// of all the bytes. --corrupt: P flips one byte of one page after its checksum (every repeat);
// D must report exactly that page.
//
// Usage: ipc_transfer_bench [--lengths 4096,32768,131072] [--repeats 5]
//   [--copy kernel|memcpy|batch] [--corrupt 0|1]. Markdown table on stdout, progress on stderr.
// Exit 1 on any failure, including a mismatch without --corrupt or a missed one with it.
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/gpu/device_memory.h"
#include "kernels/cuda/page_copy.cuh"
#include "kernels/cuda/xxh3.cuh"
#include "kvtransfer/cuda_ipc/ipc_page_arena.h"

namespace pdserve::bench {
namespace {

using kernels::cuda::PageCopy;
using kernels::cuda::Xxh3Page;
using kv::cuda_ipc::IpcArenaHandle;
using kv::cuda_ipc::IpcPageArena;
using kv::cuda_ipc::PeerArena;

constexpr int kLayers = 8;
constexpr uint64_t kHeadDim = 512;
constexpr uint64_t kIndexerDim = 128;
constexpr uint64_t kWindow = 128;
constexpr uint64_t kEntriesPerPage = 64;
constexpr uint64_t kBf16 = 2;
constexpr uint64_t kAlign = 256;

struct PageDesc {
  uint32_t page_id;
  uint32_t layer;
  uint64_t offset;  // in P's arena
  uint64_t length;
  uint64_t checksum;
};

// How D copies the pages: one kernel launch for all (kernels/cuda/page_copy.cuh), one
// cudaMemcpyAsync per page, or one cudaMemcpyBatchAsync.
enum class CopyWay { kKernel, kMemcpy, kBatch };

const char* CopyName(CopyWay c) {
  switch (c) {
    case CopyWay::kKernel:
      return "copy_pages kernel";
    case CopyWay::kMemcpy:
      return "cudaMemcpyAsync per page";
    case CopyWay::kBatch:
      return "cudaMemcpyBatchAsync";
  }
  return "?";
}

struct Options {
  std::vector<int64_t> lengths = {4096, 32768, 131072};
  int repeats = 5;
  CopyWay copy = CopyWay::kKernel;
  bool corrupt = false;
};

// The pages of one prompt of `tokens`, laid out back to back (256-aligned) from offset 0.
std::vector<PageDesc> PromptPages(int64_t tokens) {
  std::vector<PageDesc> pages;
  uint64_t at = 0;
  auto add = [&](int layer, uint64_t bytes) {
    pages.push_back(
        {static_cast<uint32_t>(pages.size()), static_cast<uint32_t>(layer), at, bytes, 0});
    at += (bytes + kAlign - 1) / kAlign * kAlign;
  };
  auto add_entries = [&](int layer, uint64_t entries, uint64_t entry_bytes) {
    for (uint64_t e = 0; e < entries; e += kEntriesPerPage) {
      add(layer, std::min(kEntriesPerPage, entries - e) * entry_bytes);
    }
  };
  for (int layer = 0; layer < kLayers; ++layer) {
    const bool csa = layer % 2 == 0;
    const uint64_t rate = csa ? 4 : 128;
    const uint64_t compressed = static_cast<uint64_t>(tokens) / rate;
    add(layer, kWindow * kHeadDim * kBf16);
    add_entries(layer, compressed, kHeadDim * kBf16);
    if (csa) add_entries(layer, compressed, kIndexerDim * kBf16);
    // The compressor's partial-window buffers (kv and gate; CSA's overlapping two windows).
    add(layer, (csa ? 2 * rate : rate) * 2 * kHeadDim * kBf16);
  }
  return pages;
}

uint64_t TotalBytes(const std::vector<PageDesc>& pages) {
  uint64_t total = 0;
  for (const PageDesc& p : pages) total += p.length;
  return total;
}

uint64_t ArenaBytes(const std::vector<PageDesc>& pages) {
  return pages.back().offset + (pages.back().length + kAlign - 1) / kAlign * kAlign;
}

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

absl::Status SendAll(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n <= 0) return absl::UnavailableError(absl::StrCat("socket write: ", std::strerror(errno)));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = read(fd, p, bytes);
    if (n <= 0) return absl::UnavailableError("socket read: peer closed or failed");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status SendVector(int fd, const std::vector<T>& v) {
  const uint64_t n = v.size();
  if (absl::Status s = SendAll(fd, &n, sizeof(n)); !s.ok()) return s;
  return SendAll(fd, v.data(), n * sizeof(T));
}

template <typename T>
absl::StatusOr<std::vector<T>> RecvVector(int fd) {
  uint64_t n = 0;
  if (absl::Status s = RecvAll(fd, &n, sizeof(n)); !s.ok()) return s;
  std::vector<T> v(n);
  if (absl::Status s = RecvAll(fd, v.data(), n * sizeof(T)); !s.ok()) return s;
  return v;
}

#define BENCH_RETURN_IF_ERROR(expr)              \
  do {                                           \
    const absl::Status bench_status = (expr);    \
    if (!bench_status.ok()) return bench_status; \
  } while (0)

// ---- The decode process ----

// One result line from D per repeat: its share and the separately timed parts.
struct DecodeTimes {
  double verify_ms;     // descriptors received -> verdict (copy + checksum + compare)
  double copy_ms;       // the copies alone (a second run of them)
  double checksum_ms;   // the checksum kernel alone over D's pages
  double floor_a_ms;    // D2H + H2D of the same bytes through pinned host memory
  double floor_d2d_ms;  // one device -> device cudaMemcpy of the same bytes
  int64_t mismatched;
  int64_t first_mismatch;
};

class Decode {
 public:
  Decode(int fd, CopyWay copy) : fd_(fd), copy_(copy) {}

  absl::Status Run() {
    absl::StatusOr<std::vector<IpcArenaHandle>> handle = RecvVector<IpcArenaHandle>(fd_);
    if (!handle.ok()) return handle.status();
    const double open_start = NowMs();
    absl::StatusOr<std::unique_ptr<PeerArena>> peer = PeerArena::Open(handle->front());
    if (!peer.ok()) return peer.status();
    peer_ = std::move(*peer);
    const double open_ms = NowMs() - open_start;
    BENCH_RETURN_IF_ERROR(SendAll(fd_, &open_ms, sizeof(open_ms)));
    PDSERVE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    while (true) {
      absl::StatusOr<std::vector<PageDesc>> pages = RecvVector<PageDesc>(fd_);
      if (!pages.ok()) return pages.status();
      if (pages->empty()) return absl::OkStatus();
      const double start = NowMs();
      absl::StatusOr<DecodeTimes> times = Receive(*pages);
      if (!times.ok()) return times.status();
      times->verify_ms = NowMs() - start;
      const int64_t verdict[2] = {times->mismatched, times->first_mismatch};
      BENCH_RETURN_IF_ERROR(SendAll(fd_, verdict, sizeof(verdict)));
      // After the verdict (outside P's clock): the parts alone and the floors.
      BENCH_RETURN_IF_ERROR(TimeParts(*pages, *times));
      BENCH_RETURN_IF_ERROR(SendAll(fd_, &*times, sizeof(DecodeTimes)));
    }
  }

  ~Decode() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

 private:
  // D's page table for `pages`: each page at a shuffled 256-aligned slot of D's pool.
  absl::Status Place(const std::vector<PageDesc>& pages) {
    const uint64_t bytes = ArenaBytes(pages);
    if (pool_.size() < bytes) BENCH_RETURN_IF_ERROR(pool_.Allocate(bytes));
    std::vector<size_t> order(pages.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(pages.size()));
    dst_.assign(pages.size(), nullptr);
    src_.assign(pages.size(), nullptr);
    sizes_.assign(pages.size(), 0);
    std::vector<Xxh3Page> own(pages.size());
    std::vector<PageCopy> copies(pages.size());
    uint64_t at = 0;
    for (size_t k : order) {
      absl::StatusOr<const void*> src = peer_->Range(pages[k].offset, pages[k].length);
      if (!src.ok()) return src.status();
      dst_[k] = pool_.get() + at;
      src_[k] = *src;
      sizes_[k] = pages[k].length;
      own[k] = {dst_[k], pages[k].length};
      copies[k] = {src_[k], dst_[k], pages[k].length};
      at += (pages[k].length + kAlign - 1) / kAlign * kAlign;
    }
    // The descriptor and hash arrays grow only (no cudaMalloc / cudaFree on the timed path
    // after the first prompt of a size).
    if (own_pages_.size() < own.size()) BENCH_RETURN_IF_ERROR(own_pages_.Allocate(own.size()));
    if (hashes_.size() < own.size()) BENCH_RETURN_IF_ERROR(hashes_.Allocate(own.size()));
    if (copies_.size() < own.size()) BENCH_RETURN_IF_ERROR(copies_.Allocate(own.size()));
    PDSERVE_CUDA_RETURN(cudaMemcpyAsync(copies_.get(), copies.data(),
                                        copies.size() * sizeof(PageCopy), cudaMemcpyHostToDevice,
                                        stream_));
    pages_ = own.size();
    PDSERVE_CUDA_RETURN(cudaMemcpyAsync(own_pages_.get(), own.data(), own.size() * sizeof(Xxh3Page),
                                        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }

  absl::Status Copy() {
    if (copy_ == CopyWay::kKernel) {
      PDSERVE_CUDA_RETURN(
          kernels::cuda::copy_pages(copies_.get(), static_cast<int64_t>(pages_), stream_));
      return absl::OkStatus();
    }
    if (copy_ == CopyWay::kMemcpy) {
      for (size_t i = 0; i < dst_.size(); ++i) {
        PDSERVE_CUDA_RETURN(
            cudaMemcpyAsync(dst_[i], src_[i], sizes_[i], cudaMemcpyDeviceToDevice, stream_));
      }
      return absl::OkStatus();
    }
    cudaMemcpyAttributes attrs = {};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attrs_index = 0;
    PDSERVE_CUDA_RETURN(cudaMemcpyBatchAsync(dst_.data(), src_.data(), sizes_.data(), dst_.size(),
                                             &attrs, &attrs_index, 1, stream_));
    return absl::OkStatus();
  }

  absl::Status Checksum() {
    PDSERVE_CUDA_RETURN(kernels::cuda::xxh3_64_pages(own_pages_.get(), static_cast<int64_t>(pages_),
                                                     hashes_.get(), stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<DecodeTimes> Receive(const std::vector<PageDesc>& pages) {
    BENCH_RETURN_IF_ERROR(Place(pages));
    BENCH_RETURN_IF_ERROR(Copy());
    BENCH_RETURN_IF_ERROR(Checksum());
    std::vector<uint64_t> got(pages.size());
    PDSERVE_CUDA_RETURN(cudaMemcpyAsync(got.data(), hashes_.get(), got.size() * sizeof(uint64_t),
                                        cudaMemcpyDeviceToHost, stream_));
    PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream_));
    DecodeTimes t = {};
    t.first_mismatch = -1;
    for (size_t i = 0; i < pages.size(); ++i) {
      if (got[i] == pages[i].checksum) continue;
      if (t.mismatched++ == 0) t.first_mismatch = pages[i].page_id;
    }
    return t;
  }

  // Milliseconds of `work` on stream_, by events.
  template <typename F>
  absl::StatusOr<double> TimeOnStream(F work) {
    cudaEvent_t start, stop;
    PDSERVE_CUDA_RETURN(cudaEventCreate(&start));
    PDSERVE_CUDA_RETURN(cudaEventCreate(&stop));
    PDSERVE_CUDA_RETURN(cudaEventRecord(start, stream_));
    absl::Status s = work();
    PDSERVE_CUDA_RETURN(cudaEventRecord(stop, stream_));
    PDSERVE_CUDA_RETURN(cudaEventSynchronize(stop));
    float ms = 0;
    PDSERVE_CUDA_RETURN(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (!s.ok()) return s;
    return static_cast<double>(ms);
  }

  absl::Status TimeParts(const std::vector<PageDesc>& pages, DecodeTimes& t) {
    absl::StatusOr<double> ms = TimeOnStream([&] { return Copy(); });
    if (!ms.ok()) return ms.status();
    t.copy_ms = *ms;
    ms = TimeOnStream([&] { return Checksum(); });
    if (!ms.ok()) return ms.status();
    t.checksum_ms = *ms;
    const uint64_t bytes = TotalBytes(pages);
    if (staging_bytes_ < bytes) {
      if (staging_ != nullptr) cudaFreeHost(staging_);
      staging_ = nullptr;
      PDSERVE_CUDA_RETURN(cudaMallocHost(&staging_, bytes));
      staging_bytes_ = bytes;
      BENCH_RETURN_IF_ERROR(scratch_.Allocate(bytes));
    }
    ms = TimeOnStream([&] {
      PDSERVE_CUDA_RETURN(
          cudaMemcpyAsync(staging_, pool_.get(), bytes, cudaMemcpyDeviceToHost, stream_));
      PDSERVE_CUDA_RETURN(
          cudaMemcpyAsync(scratch_.get(), staging_, bytes, cudaMemcpyHostToDevice, stream_));
      return absl::OkStatus();
    });
    if (!ms.ok()) return ms.status();
    t.floor_a_ms = *ms;
    ms = TimeOnStream([&] {
      PDSERVE_CUDA_RETURN(
          cudaMemcpyAsync(scratch_.get(), pool_.get(), bytes, cudaMemcpyDeviceToDevice, stream_));
      return absl::OkStatus();
    });
    if (!ms.ok()) return ms.status();
    t.floor_d2d_ms = *ms;
    return absl::OkStatus();
  }

  int fd_;
  CopyWay copy_;
  std::unique_ptr<PeerArena> peer_;
  cudaStream_t stream_ = nullptr;
  engine::gpu::DeviceArray<uint8_t> pool_;
  engine::gpu::DeviceArray<uint8_t> scratch_;
  engine::gpu::DeviceArray<Xxh3Page> own_pages_;
  engine::gpu::DeviceArray<uint64_t> hashes_;
  engine::gpu::DeviceArray<PageCopy> copies_;
  std::vector<void*> dst_;
  std::vector<const void*> src_;
  std::vector<size_t> sizes_;
  size_t pages_ = 0;  // pages of the current prompt (own_pages_ / hashes_ may be longer)
  void* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
};

// ---- The prefill process ----

struct Row {
  int64_t tokens;
  uint64_t bytes;
  size_t pages;
  std::vector<double> e2e_ms, prefill_export_ms;
  std::vector<DecodeTimes> decode;
  int64_t mismatched = 0;
  bool verdicts_right = true;
};

absl::Status RunPrefill(int fd, const Options& opt, double* open_ms, std::vector<Row>* rows) {
  const std::vector<PageDesc> largest =
      PromptPages(*std::max_element(opt.lengths.begin(), opt.lengths.end()));
  absl::StatusOr<std::unique_ptr<IpcPageArena>> arena =
      IpcPageArena::Create(0, ArenaBytes(largest));
  if (!arena.ok()) return arena.status();
  IpcPageArena& a = **arena;
  // The prefill slot the pages are gathered from (random bytes, written once): the pages sit
  // there in reverse order, so the gather is a real permutation.
  engine::gpu::DeviceArray<uint8_t> slot;
  {
    std::vector<uint8_t> host(a.bytes());
    std::mt19937_64 rng(27);
    for (size_t i = 0; i + 8 <= host.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(&host[i], &r, 8);
    }
    BENCH_RETURN_IF_ERROR(slot.Upload(host));
  }
  BENCH_RETURN_IF_ERROR(SendVector(fd, std::vector<IpcArenaHandle>{a.handle()}));
  BENCH_RETURN_IF_ERROR(RecvAll(fd, open_ms, sizeof(*open_ms)));
  cudaStream_t stream;
  PDSERVE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  engine::gpu::DeviceArray<Xxh3Page> arena_pages;
  engine::gpu::DeviceArray<PageCopy> gathers;
  engine::gpu::DeviceArray<uint64_t> hashes;
  std::mt19937_64 rng(54);
  for (int64_t tokens : opt.lengths) {
    std::vector<PageDesc> pages = PromptPages(tokens);
    Row row{tokens, TotalBytes(pages), pages.size(), {}, {}, {}};
    std::vector<Xxh3Page> own(pages.size());
    std::vector<PageCopy> gather(pages.size());
    uint64_t slot_at = 0;  // the slot holds the pages last to first
    for (size_t i = pages.size(); i-- > 0;) {
      auto* page = static_cast<uint8_t*>(a.data()) + pages[i].offset;
      own[i] = {page, pages[i].length};
      gather[i] = {slot.get() + slot_at, page, pages[i].length};
      slot_at += (pages[i].length + kAlign - 1) / kAlign * kAlign;
    }
    BENCH_RETURN_IF_ERROR(arena_pages.Upload(own));
    BENCH_RETURN_IF_ERROR(gathers.Upload(gather));
    BENCH_RETURN_IF_ERROR(hashes.Allocate(pages.size()));
    std::vector<uint64_t> sums(pages.size());
    for (int r = 0; r < opt.repeats + 1; ++r) {  // the first is a warm-up, not counted
      const double t0 = NowMs();
      // The export: the slot's pages gathered into the arena, then their checksums.
      PDSERVE_CUDA_RETURN(
          kernels::cuda::copy_pages(gathers.get(), static_cast<int64_t>(pages.size()), stream));
      PDSERVE_CUDA_RETURN(kernels::cuda::xxh3_64_pages(
          arena_pages.get(), static_cast<int64_t>(pages.size()), hashes.get(), stream));
      PDSERVE_CUDA_RETURN(cudaMemcpyAsync(sums.data(), hashes.get(), sums.size() * 8,
                                          cudaMemcpyDeviceToHost, stream));
      PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
      const double checksummed = NowMs();
      for (size_t i = 0; i < pages.size(); ++i) pages[i].checksum = sums[i];
      int64_t flipped = -1;
      if (opt.corrupt) {
        flipped = static_cast<int64_t>(rng() % pages.size());
        auto* at =
            static_cast<uint8_t*>(a.data()) + pages[flipped].offset + rng() % pages[flipped].length;
        uint8_t byte = 0;
        PDSERVE_CUDA_RETURN(cudaMemcpy(&byte, at, 1, cudaMemcpyDeviceToHost));
        byte ^= 0x10;
        PDSERVE_CUDA_RETURN(cudaMemcpy(at, &byte, 1, cudaMemcpyHostToDevice));
      }
      BENCH_RETURN_IF_ERROR(SendVector(fd, pages));
      int64_t verdict[2];
      BENCH_RETURN_IF_ERROR(RecvAll(fd, verdict, sizeof(verdict)));
      const double t1 = NowMs();
      DecodeTimes d;
      BENCH_RETURN_IF_ERROR(RecvAll(fd, &d, sizeof(d)));
      // With --corrupt the next repeat's gather overwrites the flipped byte.
      row.verdicts_right &=
          opt.corrupt ? verdict[0] == 1 && verdict[1] == flipped : verdict[0] == 0;
      row.mismatched += verdict[0];
      if (r == 0) continue;
      row.e2e_ms.push_back(t1 - t0);
      row.prefill_export_ms.push_back(checksummed - t0);
      row.decode.push_back(d);
    }
    std::fprintf(stderr, "%lld tokens: %zu pages, %.1f MB, verdicts %s\n",
                 static_cast<long long>(tokens), pages.size(), row.bytes / 1e6,
                 row.verdicts_right ? "right" : "WRONG");
    rows->push_back(std::move(row));
  }
  cudaStreamDestroy(stream);
  return SendVector(fd, std::vector<PageDesc>{});
}

}  // namespace
}  // namespace pdserve::bench

namespace {

using pdserve::bench::DecodeTimes;
using pdserve::bench::Row;

double Gbps(uint64_t bytes, double ms) { return ms > 0 ? bytes / (ms * 1e6) : 0.0; }

template <typename F>
double MedianOf(const std::vector<DecodeTimes>& d, F field) {
  std::vector<double> v;
  for (const DecodeTimes& t : d) v.push_back(field(t));
  return pdserve::bench::Median(v);
}

void PrintTable(const std::vector<Row>& rows, double open_ms, pdserve::bench::CopyWay copy,
                bool corrupt) {
  std::printf("CUDA IPC, one GPU, two processes (copy: %s%s); PeerArena::Open %.2f ms once\n\n",
              pdserve::bench::CopyName(copy), corrupt ? "; one byte flipped per repeat" : "",
              open_ms);
  std::printf(
      "| prompt tokens | pages | MB | e2e ms | e2e GB/s | D verify ms | D GB/s | "
      "P export ms | copy GB/s | checksum GB/s | floor (a) GB/s | e2e / (a) | "
      "D / (a) | d2d GB/s | e2e / d2d | verdicts |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const double e2e = pdserve::bench::Median(r.e2e_ms);
    const double verify = MedianOf(r.decode, [](const DecodeTimes& t) { return t.verify_ms; });
    const double copy_ms = MedianOf(r.decode, [](const DecodeTimes& t) { return t.copy_ms; });
    const double sum = MedianOf(r.decode, [](const DecodeTimes& t) { return t.checksum_ms; });
    const double fa = MedianOf(r.decode, [](const DecodeTimes& t) { return t.floor_a_ms; });
    const double fd = MedianOf(r.decode, [](const DecodeTimes& t) { return t.floor_d2d_ms; });
    std::printf(
        "| %lld | %zu | %.1f | %.3f | %.1f | %.3f | %.1f | %.3f | %.1f | %.1f | %.1f | "
        "%.0f%% | %.0f%% | %.1f | %.0f%% | %s |\n",
        static_cast<long long>(r.tokens), r.pages, r.bytes / 1e6, e2e, Gbps(r.bytes, e2e), verify,
        Gbps(r.bytes, verify), pdserve::bench::Median(r.prefill_export_ms), Gbps(r.bytes, copy_ms),
        Gbps(r.bytes, sum), Gbps(r.bytes, fa), 100.0 * fa / e2e, 100.0 * fa / verify,
        Gbps(r.bytes, fd), 100.0 * fd / e2e, r.verdicts_right ? "right" : "WRONG");
  }
}

bool ParseArgs(int argc, char** argv, pdserve::bench::Options* opt) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--lengths") {
      opt->lengths.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        int64_t n = 0;
        if (!absl::SimpleAtoi(part, &n) || n <= 0) return false;
        opt->lengths.push_back(n);
      }
    } else if (flag == "--repeats") {
      if (!absl::SimpleAtoi(value, &opt->repeats) || opt->repeats < 1) return false;
    } else if (flag == "--copy") {
      using pdserve::bench::CopyWay;
      if (value == "kernel") {
        opt->copy = CopyWay::kKernel;
      } else if (value == "memcpy") {
        opt->copy = CopyWay::kMemcpy;
      } else if (value == "batch") {
        opt->copy = CopyWay::kBatch;
      } else {
        return false;
      }
    } else if (flag == "--corrupt") {
      opt->corrupt = value == "1";
    } else {
      return false;
    }
  }
  return argc % 2 == 1 && !opt->lengths.empty();
}

}  // namespace

int main(int argc, char** argv) {
  pdserve::bench::Options opt;
  if (!ParseArgs(argc, argv, &opt)) {
    std::fprintf(
        stderr,
        "usage: %s [--lengths 4096,32768,131072] [--repeats 5] [--copy kernel|memcpy|batch] "
        "[--corrupt 0|1]\n",
        argv[0]);
    return 2;
  }
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
    std::perror("socketpair");
    return 1;
  }
  // Forked before either process touches CUDA.
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    close(fds[0]);
    pdserve::bench::Decode decode(fds[1], opt.copy);
    const absl::Status s = decode.Run();
    if (!s.ok()) std::fprintf(stderr, "decode process: %s\n", s.ToString().c_str());
    _exit(s.ok() ? 0 : 1);
  }
  close(fds[1]);
  double open_ms = 0;
  std::vector<Row> rows;
  const absl::Status s = pdserve::bench::RunPrefill(fds[0], opt, &open_ms, &rows);
  if (!s.ok()) std::fprintf(stderr, "prefill process: %s\n", s.ToString().c_str());
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  const bool decode_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!rows.empty()) PrintTable(rows, open_ms, opt.copy, opt.corrupt);
  bool verdicts_right = true;
  for (const Row& r : rows) verdicts_right &= r.verdicts_right;
  return s.ok() && decode_ok && verdicts_right ? 0 : 1;
}
