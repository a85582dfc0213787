// kvtransfer/cuda_ipc: the producer's arena and a peer process's mapping of it (label gpu; the
// checks that need no GPU run everywhere). The peer is this binary run again
// (PDSERVE_IPC_PEER_HANDLE set): CUDA cannot be used in a process forked after it started.
#include "kvtransfer/cuda_ipc/ipc_page_arena.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/gpu/device_memory.h"
#include "kernels/cuda/xxh3.cuh"
#include "kvtransfer/cuda_ipc/cuda_page_lander.h"
#include "tests/common/switch_warnings.h"

namespace pdserve::kv::cuda_ipc {
namespace {

bool HasGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string HandleHex(const IpcArenaHandle& h) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&h), sizeof(h)));
}

// The GPU's XXH3-64 of `bytes` at `data` (device memory).
uint64_t GpuChecksum(const void* data, uint64_t bytes) {
  engine::gpu::DeviceArray<kernels::cuda::Xxh3Page> page;
  engine::gpu::DeviceArray<uint64_t> hash;
  if (!page.Upload({{data, bytes}}).ok() || !hash.Allocate(1).ok()) return 0;
  if (kernels::cuda::xxh3_64_pages(page.get(), 1, hash.get(), nullptr) != cudaSuccess) return 0;
  uint64_t out = 0;
  cudaMemcpy(&out, hash.get(), sizeof(out), cudaMemcpyDeviceToHost);
  return out;
}

// Runs this binary as the peer: it maps the arena, checks [offset, offset + length)'s checksum
// and the out-of-range refusal, then writes 0x5A over the range. Returns its exit status.
int RunPeer(const IpcArenaHandle& h, uint64_t offset, uint64_t length, uint64_t checksum) {
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("PDSERVE_IPC_PEER_HANDLE", HandleHex(h).c_str(), 1);
    setenv("PDSERVE_IPC_PEER_RANGE", absl::StrCat(offset, ",", length, ",", checksum).c_str(), 1);
    execl("/proc/self/exe", "ipc_page_arena_peer", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

int PeerMain(const char* handle_hex, const char* range) {
  const std::string bytes = absl::HexStringToBytes(handle_hex);
  IpcArenaHandle h;
  if (bytes.size() != sizeof(h)) return 10;
  std::memcpy(&h, bytes.data(), sizeof(h));
  uint64_t offset = 0, length = 0, checksum = 0;
  if (std::sscanf(range, "%lu,%lu,%lu", &offset, &length, &checksum) != 3) return 11;
  absl::StatusOr<std::unique_ptr<PeerArena>> peer = PeerArena::Open(h);
  if (!peer.ok()) {
    std::fprintf(stderr, "peer: %s\n", peer.status().ToString().c_str());
    return 12;
  }
  if ((*peer)->bytes() != h.bytes) return 13;
  if ((*peer)->Range(h.bytes - 8, 16).status().code() != absl::StatusCode::kOutOfRange) return 14;
  absl::StatusOr<const void*> at = (*peer)->Range(offset, length);
  if (!at.ok()) return 15;
  // On a mismatch: whether the bytes differ (the CPU's XXH3 of a host copy) or only the GPU's
  // hash of them, and where the arena sits in the peer's mapping.
  if (const uint64_t gpu = GpuChecksum(*at, length); gpu != checksum) {
    std::vector<uint8_t> copy(length);
    const bool copied = cudaMemcpy(copy.data(), *at, length, cudaMemcpyDeviceToHost) == cudaSuccess;
    std::fprintf(stderr,
                 "peer: GPU XXH3 %016lx, the producer's %016lx; CPU XXH3 of the peer's bytes "
                 "%016lx (copied: %d); handle offset %lu, mapping %p\n",
                 static_cast<unsigned long>(gpu), static_cast<unsigned long>(checksum),
                 static_cast<unsigned long>(copied ? XXH3_64bits(copy.data(), length) : 0),
                 copied ? 1 : 0, static_cast<unsigned long>(h.offset), (*peer)->data());
    return 16;
  }
  if (cudaMemset(const_cast<void*>(*at), 0x5A, length) != cudaSuccess) return 17;
  if (cudaDeviceSynchronize() != cudaSuccess) return 18;
  return 0;
}

// The lander's peer: maps the arena through a CudaPageLander, lands `pages` pages of the arena
// (page i at offset i * stride, length length_i = stride - 8 * i, odd ones unaligned by 1 byte
// less) into its own device pages in one Flush, and checks every landed page against the
// arena's bytes (read through the mapping) and every hash against libxxhash on those bytes;
// then a page outside the arena and an arena that does not exist are refused at Add. Exit 0 when
// all hold, else the first failed check's number.
int LanderPeerMain(const char* handle_hex, const char* layout) {
  const std::string bytes = absl::HexStringToBytes(handle_hex);
  IpcArenaHandle h;
  if (bytes.size() != sizeof(h)) return 20;
  std::memcpy(&h, bytes.data(), sizeof(h));
  uint64_t pages = 0, stride = 0;
  if (std::sscanf(layout, "%lu,%lu", &pages, &stride) != 2) return 21;
  absl::StatusOr<int> device = CheckIpcUsable(h);
  if (!device.ok()) return 22;
  auto cache = std::make_shared<PeerArenaCache>();
  absl::StatusOr<std::unique_ptr<CudaPageLander>> lander = CudaPageLander::Create(*device, cache);
  if (!lander.ok()) return 23;
  engine::gpu::DeviceArray<std::byte> own;
  if (!own.Allocate(pages * stride).ok()) return 24;
  const shm::IpcRegionName name = NameOf(h);
  std::vector<uint64_t> lengths;
  for (uint64_t i = 0; i < pages; ++i) {
    lengths.push_back(stride - 8 * i - (i % 2));
    const LandingTarget target{
        {own.get() + i * stride, lengths[i]}, 1, static_cast<uint32_t>(i), {}, true};
    if (!(*lander)
             ->Add({.device = name, .offset = i * stride, .length = lengths[i]}, target)
             .ok()) {
      return 25;
    }
  }
  if ((*lander)->pending() != pages) return 26;
  std::vector<uint64_t> hashes(pages, 0);
  int failed = 0;
  (*lander)->Flush([&](const LandingTarget& target, absl::Status status, uint64_t xxh3) {
    if (!status.ok()) {
      std::fprintf(stderr, "lander peer: %s\n", status.ToString().c_str());
      failed = 27;
    }
    hashes[target.slot] = xxh3;
  });
  if (failed != 0) return failed;
  if ((*lander)->pending() != 0 || (*lander)->flushes() != 1) return 28;
  absl::StatusOr<std::shared_ptr<const PeerArena>> arena = cache->Get(name);
  if (!arena.ok()) return 29;
  for (uint64_t i = 0; i < pages; ++i) {
    std::vector<uint8_t> want(lengths[i]), got(lengths[i]);
    const auto* from = static_cast<const std::byte*>((*arena)->data()) + i * stride;
    if (cudaMemcpy(want.data(), from, lengths[i], cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(got.data(), own.get() + i * stride, lengths[i], cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
      return 30;
    }
    if (want != got) return 31;
    if (hashes[i] != XXH3_64bits(want.data(), want.size())) return 32;
  }
  // A second batch through AddFromArena, in reverse order (the lander's arrays and kept arena
  // reused): the same hashes, each reported for its own slot.
  for (uint64_t i = pages; i-- > 0;) {
    const LandingTarget target{
        {own.get() + i * stride, lengths[i]}, 1, static_cast<uint32_t>(i), {}, true};
    if (!(*lander)->AddFromArena(name, i * stride, lengths[i], target).ok()) return 37;
  }
  bool same = true;
  (*lander)->Flush([&](const LandingTarget& target, absl::Status status, uint64_t xxh3) {
    same = same && status.ok() && xxh3 == hashes[target.slot];
  });
  if (!same || (*lander)->flushes() != 2) return 38;
  // Refusals at Add, nothing queued: a range past the arena's end, an arena nobody exported.
  const LandingTarget one{{own.get(), 64}, 1, 0, {}, true};
  const absl::Status outside =
      (*lander)->Add({.device = name, .offset = h.bytes - 32, .length = 64}, one);
  if (outside.code() != absl::StatusCode::kUnavailable) return 33;
  // (The driver ignores some bytes of an IPC handle: a handle with one byte changed may still
  // open the same allocation. A GPU no process here sees cannot.)
  shm::IpcRegionName bogus = name;
  bogus.pci_bus_id = "0000:ff:1f.7";
  if ((*lander)->Add({.device = bogus, .offset = 0, .length = 64}, one).code() !=
      absl::StatusCode::kUnavailable) {
    return 34;
  }
  // An arena whose stated offset or size reaches past the allocation the handle maps (the
  // wire's numbers, checked against the driver's mapping): refused at Add, never read.
  shm::IpcRegionName oversized = name;
  oversized.bytes = h.bytes + (uint64_t{1} << 40);
  if ((*lander)->Add({.device = oversized, .offset = h.bytes, .length = 64}, one).code() !=
      absl::StatusCode::kUnavailable) {
    return 39;
  }
  shm::IpcRegionName shifted = name;
  shifted.allocation_offset = UINT64_MAX - 16;
  if ((*lander)->Add({.device = shifted, .offset = 0, .length = 64}, one).code() !=
      absl::StatusCode::kUnavailable) {
    return 40;
  }
  // A host destination is not the lander's.
  const LandingTarget host{{own.get(), 64}, 1, 0, {}, false};
  if ((*lander)->Add({.device = name, .offset = 0, .length = 64}, host).ok()) return 35;
  if ((*lander)->pending() != 0) return 36;
  return 0;
}

TEST(IpcPageArenaTest, CheckRefusesAPeerOnAnotherHost) {
  IpcArenaHandle h;
  std::strcpy(h.boot_id, "00000000-0000-0000-0000-000000000000");
  absl::StatusOr<int> device = CheckIpcUsable(h);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(device.status().message().find("another host"), std::string::npos) << device.status();
}

TEST(IpcPageArenaTest, CheckRefusesAGpuNotVisibleHere) {
  absl::StatusOr<std::string> boot = HostBootId();
  ASSERT_TRUE(boot.ok()) << boot.status();
  IpcArenaHandle h;
  std::strncpy(h.boot_id, boot->c_str(), sizeof(h.boot_id) - 1);
  std::strcpy(h.pci_bus_id, "0000:ff:1f.7");
  absl::StatusOr<int> device = CheckIpcUsable(h);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(device.status().message().find("not visible"), std::string::npos) << device.status();
}

TEST(IpcPageArenaTest, CreateNamesTheFailedCudaCall) {
  if (HasGpu()) {
    absl::StatusOr<std::unique_ptr<IpcPageArena>> huge = IpcPageArena::Create(0, uint64_t{1} << 50);
    EXPECT_FALSE(huge.ok());
    EXPECT_NE(huge.status().message().find("cudaMalloc"), std::string::npos) << huge.status();
    // The failure was reported, not left for the next launch's check to return.
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  } else {
    absl::StatusOr<std::unique_ptr<IpcPageArena>> arena = IpcPageArena::Create(0, 4096);
    EXPECT_FALSE(arena.ok());
    EXPECT_NE(arena.status().message().find("cuda"), std::string::npos) << arena.status();
  }
  EXPECT_EQ(IpcPageArena::Create(0, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(IpcPageArenaTest, APeerProcessReadsAndWritesTheArena) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  constexpr uint64_t kBytes = 3 << 20;
  absl::StatusOr<std::unique_ptr<IpcPageArena>> arena = IpcPageArena::Create(0, kBytes);
  ASSERT_TRUE(arena.ok()) << arena.status();
  std::vector<uint8_t> host(kBytes);
  std::mt19937_64 rng(std::random_device{}());
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy((*arena)->data(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  const uint64_t offset = 4096 + 8 * (rng() % 1000), length = 65536 + rng() % 70000;
  auto* range = static_cast<uint8_t*>((*arena)->data()) + offset;
  const uint64_t checksum = GpuChecksum(range, length);
  // The GPU's hash is the specification's (libxxhash on the host bytes): the peer's check below
  // compares like with like.
  ASSERT_EQ(checksum, XXH3_64bits(host.data() + offset, length))
      << "offset " << offset << " length " << length;
  std::printf("arena offset in its allocation: %lu\n",
              static_cast<unsigned long>((*arena)->handle().offset));
  ASSERT_EQ(RunPeer((*arena)->handle(), offset, length, checksum), 0);
  // The peer's writes landed in the producer's memory, only in its range; the arena outlives the
  // peer's mapping.
  std::vector<uint8_t> after(kBytes);
  ASSERT_EQ(cudaMemcpy(after.data(), (*arena)->data(), kBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (uint64_t i = 0; i < kBytes; ++i) {
    const bool inside = i >= offset && i < offset + length;
    ASSERT_EQ(after[i], inside ? 0x5A : host[i]) << "byte " << i;
  }
  // A wrong checksum is the peer's failure, not a pass.
  EXPECT_EQ(RunPeer((*arena)->handle(), offset, length, checksum ^ 1), 16);
}

// Each lander mode (PDSERVE_CUDA_LANDER: descriptors and hashes copied on the stream, read and
// written by the kernels in pinned host memory, or that with the copy and hash in one kernel)
// lands every byte and hash.
class CudaPageLanderTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaPageLanderTest, APeerLandsABatchOfArenaPagesWithTheirChecksums) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  constexpr uint64_t kPagesInBatch = 37, kStride = 48 * 1024;
  absl::StatusOr<std::unique_ptr<IpcPageArena>> arena =
      IpcPageArena::Create(0, kPagesInBatch * kStride);
  ASSERT_TRUE(arena.ok()) << arena.status();
  std::vector<uint8_t> host(kPagesInBatch * kStride);
  std::mt19937_64 rng(std::random_device{}());
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy((*arena)->data(), host.data(), host.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("PDSERVE_IPC_LANDER_PEER", HandleHex((*arena)->handle()).c_str(), 1);
    setenv("PDSERVE_IPC_PEER_RANGE", absl::StrCat(kPagesInBatch, ",", kStride).c_str(), 1);
    setenv("PDSERVE_CUDA_LANDER", GetParam(), 1);
    execl("/proc/self/exe", "ipc_page_lander_peer", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaPageLanderTest, ::testing::Values("staged", "mapped", "fused"));

TEST(CudaPageLanderModeTest, ModesParseAndAnUnknownOneIsRefused) {
  EXPECT_EQ(*ParseLanderMode("staged"), LanderMode::kStaged);
  EXPECT_EQ(*ParseLanderMode("mapped"), LanderMode::kMapped);
  EXPECT_EQ(*ParseLanderMode("fused"), LanderMode::kFused);
  EXPECT_EQ(ParseLanderMode("fast").status().code(), absl::StatusCode::kInvalidArgument);
}

// PDSERVE_CUDA_LANDER (no GPU needed): the three names, fused when unset; another value is warned
// about once and gives fused (it used to fail every lander's Create, so every landing).
TEST(CudaPageLanderModeTest, TheSwitchTakesTheNamesAndWarnsAboutOtherText) {
  const testing::CapturedSwitchWarnings warnings;
  unsetenv("PDSERVE_CUDA_LANDER");
  EXPECT_EQ(LanderModeFromEnv(), LanderMode::kFused);
  setenv("PDSERVE_CUDA_LANDER", "staged", 1);
  EXPECT_EQ(LanderModeFromEnv(), LanderMode::kStaged);
  setenv("PDSERVE_CUDA_LANDER", "mapped", 1);
  EXPECT_EQ(LanderModeFromEnv(), LanderMode::kMapped);
  setenv("PDSERVE_CUDA_LANDER", "fused", 1);
  EXPECT_EQ(LanderModeFromEnv(), LanderMode::kFused);
  EXPECT_TRUE(warnings.lines().empty());
  for (const char* other : {"fast", "Mapped"}) {
    setenv("PDSERVE_CUDA_LANDER", other, 1);
    EXPECT_EQ(LanderModeFromEnv(), LanderMode::kFused) << other;
  }
  unsetenv("PDSERVE_CUDA_LANDER");
  ASSERT_EQ(warnings.lines().size(), 1u);
  EXPECT_EQ(warnings.lines()[0],
            "PDSERVE_CUDA_LANDER='fast' is not accepted (accepted: staged, mapped, fused); "
            "ignored, using the default, fused");
}

TEST(CudaPageLanderNameTest, HandleAndNameRoundTrip) {
  IpcArenaHandle h;
  std::memset(&h.memory, 0x3c, sizeof(h.memory));
  h.bytes = 12345;
  h.offset = 512;
  std::strcpy(h.pci_bus_id, "0000:19:00.0");
  std::strcpy(h.boot_id, "boot-id");
  const shm::IpcRegionName name = NameOf(h);
  EXPECT_EQ(name.pci_bus_id, "0000:19:00.0");
  EXPECT_EQ(name.allocation_offset, 512u);
  const IpcArenaHandle back = HandleOf(name);
  EXPECT_EQ(std::memcmp(&back, &h, sizeof(h)), 0);
}

TEST(IpcPageArenaTest, OpeningOnesOwnHandleFailsNamingTheCall) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<IpcPageArena>> arena = IpcPageArena::Create(0, 1 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<std::unique_ptr<PeerArena>> peer = PeerArena::Open((*arena)->handle());
  ASSERT_FALSE(peer.ok());
  EXPECT_NE(peer.status().message().find("cudaIpcOpenMemHandle"), std::string::npos)
      << peer.status();
}

}  // namespace
}  // namespace pdserve::kv::cuda_ipc

int main(int argc, char** argv) {
  if (const char* h = std::getenv("PDSERVE_IPC_LANDER_PEER")) {
    return pdserve::kv::cuda_ipc::LanderPeerMain(h, std::getenv("PDSERVE_IPC_PEER_RANGE"));
  }
  if (const char* h = std::getenv("PDSERVE_IPC_PEER_HANDLE")) {
    return pdserve::kv::cuda_ipc::PeerMain(h, std::getenv("PDSERVE_IPC_PEER_RANGE"));
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
