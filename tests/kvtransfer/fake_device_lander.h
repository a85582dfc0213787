// A host stand-in for the GPU in the CUDA IPC path's CPU tests (docs/protocol.md, "Same-host
// device-to-device pages (CUDA IPC)"): "arenas" and "device" destinations are host memory, and
// FakeLander copies and checksums with memcpy and the CPU's XXH3, in the batches the real
// lander (kvtransfer/cuda_ipc/cuda_page_lander.h) runs on the GPU.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/pull.h"

namespace pdserve::kv::testing {

// Host memory standing in for GPU arenas: an arena's name carries its id in the handle's first
// byte. Shared by the test and its landers (a test that adds arenas while landers run takes
// `mu`).
struct FakeArenas {
  mutable absl::Mutex mu;
  std::map<uint8_t, std::span<std::byte>> arenas;
};

// A test's hold on its landers' Flushes (shared by the test and the lane threads):
// `hold` keeps every queued page queued (a batch the GPU has not run yet); `fail` > 0 makes
// that many Flushes fail part way, as a CUDA error after the copy launch would: the batch's
// first half is copied, and every page of it is reported failed.
struct FakeLanderGate {
  std::atomic<bool> hold{false};
  std::atomic<int> fail{0};
};

// The lander over FakeArenas: memcpy + PayloadChecksum per page, at Flush.
class FakeLander final : public shm::DevicePageLander {
 public:
  FakeLander(const FakeArenas& arenas, std::vector<size_t>* flushes, FakeLanderGate* gate = nullptr)
      : arenas_(arenas), flushes_(flushes), gate_(gate) {}
  absl::Status Add(const shm::PageRef& ref, const LandingTarget& target) override {
    if (!ref.device.has_value() || !target.device || ref.length != target.destination.size()) {
      return absl::InvalidArgumentError("not a GPU page for a GPU destination of its size");
    }
    std::span<std::byte> arena;
    {
      absl::MutexLock lock(&arenas_.mu);
      auto found = arenas_.arenas.find(static_cast<uint8_t>(ref.device->memory[0]));
      if (found == arenas_.arenas.end()) return absl::UnavailableError("cuda ipc: no such arena");
      arena = found->second;
    }
    if (ref.offset > arena.size() || ref.length > arena.size() - ref.offset) {
      return absl::UnavailableError("cuda ipc: outside the arena");
    }
    queued_.push_back({arena.subspan(ref.offset, ref.length), target});
    return absl::OkStatus();
  }
  void Flush(
      const std::function<void(const LandingTarget&, absl::Status, uint64_t)>& landed) override {
    if (gate_ != nullptr && gate_->hold.load()) return;
    if (flushes_ != nullptr) flushes_->push_back(queued_.size());
    std::vector<Queued> batch;
    batch.swap(queued_);
    if (gate_ != nullptr && gate_->fail.load() > 0) {
      gate_->fail.fetch_sub(1);
      for (size_t i = 0; i < batch.size() / 2; ++i) {
        std::memcpy(batch[i].target.destination.data(), batch[i].source.data(),
                    batch[i].source.size());
      }
      for (const Queued& q : batch) {
        landed(q.target, absl::UnavailableError("cuda ipc: the batch failed (test)"), 0);
      }
      return;
    }
    for (const Queued& q : batch) {
      std::memcpy(q.target.destination.data(), q.source.data(), q.source.size());
      landed(q.target, absl::OkStatus(), PayloadChecksum(q.target.destination));
    }
  }
  size_t pending() const override { return queued_.size(); }

 private:
  struct Queued {
    std::span<const std::byte> source;
    LandingTarget target;
  };
  const FakeArenas& arenas_;
  std::vector<size_t>* flushes_;
  FakeLanderGate* gate_;
  std::vector<Queued> queued_;
};

}  // namespace pdserve::kv::testing
