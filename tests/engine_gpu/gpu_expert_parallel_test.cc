// Expert parallelism on the GPU engine (engine/gpu/gpu_model_group.h): the communicators'
// collectives give exact values, padding rows and idle calls leave the real rows alone, and a
// 2-rank group (routed experts split over the ranks, each rank prefilling and decoding its own
// requests with different batch sizes) gives the 1-rank model's logits within bf16 tolerance and
// its greedy tokens, on the transformers fixtures and the bundled model. The 2 ranks share GPU 0
// through the in-process communicator (NCCL refuses two ranks on one GPU); NCCL runs as a 1-rank
// group on one GPU (graph capture of its collectives) and as a 2-rank group where two GPUs exist.
// Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/expert_parallel.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/gpu_model_group.h"
#include "engine/gpu/local_comm.h"
#ifdef PDSERVE_HAVE_NCCL
#include "engine/gpu/nccl_comm.h"
#endif
#include "tests/engine_gpu/gpu_test_models.h"

namespace pdserve::engine::gpu {
namespace {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Each rank's thread: all-gathers two buffers of different sizes and reduce-scatters fp32 parts,
// with values small integers so every sum is exact.
void RunCollectives(ExpertComm& comm, int64_t world, std::vector<float>* gathered_a,
                    std::vector<int32_t>* gathered_b, std::vector<float>* reduced) {
  const int64_t r = comm.rank();
  ASSERT_EQ(cudaSetDevice(comm.device()), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  constexpr int64_t kA = 5;
  constexpr int64_t kB = 3;
  constexpr int64_t kCount = 7;
  std::vector<float> a(kA);
  std::vector<int32_t> b(kB);
  std::vector<float> parts(static_cast<size_t>(world * kCount));
  for (int64_t i = 0; i < kA; ++i) a[static_cast<size_t>(i)] = static_cast<float>(100 * r + i);
  for (int64_t i = 0; i < kB; ++i) b[static_cast<size_t>(i)] = static_cast<int32_t>(-10 * r - i);
  for (size_t i = 0; i < parts.size(); ++i) parts[i] = static_cast<float>((r + 1) * (i + 1));
  DeviceArray<float> send_a, recv_a, send_parts, recv_parts;
  DeviceArray<int32_t> send_b, recv_b;
  ASSERT_TRUE(send_a.Upload(a).ok());
  ASSERT_TRUE(send_b.Upload(b).ok());
  ASSERT_TRUE(send_parts.Upload(parts).ok());
  ASSERT_TRUE(recv_a.Allocate(static_cast<size_t>(world * kA)).ok());
  ASSERT_TRUE(recv_b.Allocate(static_cast<size_t>(world * kB)).ok());
  ASSERT_TRUE(recv_parts.Allocate(kCount).ok());
  const ExpertComm::Gather gathers[] = {
      {send_a.get(), recv_a.get(), kA * sizeof(float)},
      {send_b.get(), recv_b.get(), kB * sizeof(int32_t)},
  };
  ASSERT_TRUE(comm.AllGather(gathers, stream).ok());
  ASSERT_TRUE(comm.ReduceScatterSum(send_parts.get(), recv_parts.get(), kCount, stream).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  gathered_a->resize(static_cast<size_t>(world * kA));
  gathered_b->resize(static_cast<size_t>(world * kB));
  reduced->resize(kCount);
  cudaMemcpy(gathered_a->data(), recv_a.get(), gathered_a->size() * sizeof(float),
             cudaMemcpyDeviceToHost);
  cudaMemcpy(gathered_b->data(), recv_b.get(), gathered_b->size() * sizeof(int32_t),
             cudaMemcpyDeviceToHost);
  cudaMemcpy(reduced->data(), recv_parts.get(), kCount * sizeof(float), cudaMemcpyDeviceToHost);
  cudaStreamDestroy(stream);
}

void ExpectCollectiveValues(std::vector<std::unique_ptr<ExpertComm>>& comms) {
  const auto world = static_cast<int64_t>(comms.size());
  std::vector<std::vector<float>> a(comms.size()), reduced(comms.size());
  std::vector<std::vector<int32_t>> b(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] { RunCollectives(*comms[r], world, &a[r], &b[r], &reduced[r]); });
  }
  for (std::thread& t : threads) t.join();
  // sum over p of (p + 1) * (rank * 7 + i + 1) = (rank * 7 + i + 1) * world (world + 1) / 2.
  const int64_t ranks_sum = world * (world + 1) / 2;
  for (int64_t r = 0; r < world; ++r) {
    const auto& ar = a[static_cast<size_t>(r)];
    const auto& br = b[static_cast<size_t>(r)];
    const auto& rr = reduced[static_cast<size_t>(r)];
    ASSERT_EQ(ar.size(), static_cast<size_t>(world * 5));
    for (int64_t p = 0; p < world; ++p) {
      for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(ar[static_cast<size_t>(p * 5 + i)], 100 * p + i);
      for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(br[static_cast<size_t>(p * 3 + i)], -10 * p - i);
    }
    ASSERT_EQ(rr.size(), 7u);
    for (int64_t i = 0; i < 7; ++i) {
      EXPECT_EQ(rr[static_cast<size_t>(i)], static_cast<float>((r * 7 + i + 1) * ranks_sum))
          << "rank " << r << " element " << i;
    }
  }
}

TEST(LocalCommTest, ThreeRanksOnOneGpuGatherAndReduceExactly) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  auto comms = CreateLocalComms({0, 0, 0});
  ASSERT_TRUE(comms.ok()) << comms.status();
  EXPECT_EQ((*comms)[2]->rank(), 2);
  EXPECT_EQ((*comms)[2]->world(), 3);
  EXPECT_FALSE((*comms)[0]->graph_capturable());
  ExpectCollectiveValues(*comms);
  // Twice: the events and barriers are reusable.
  ExpectCollectiveValues(*comms);
}

TEST(LocalCommTest, AbortReleasesARankWaitingForAPeer) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  auto comms = CreateLocalComms({0, 0});
  ASSERT_TRUE(comms.ok()) << comms.status();
  DeviceArray<float> send, recv;
  ASSERT_TRUE(send.Allocate(4).ok());
  ASSERT_TRUE(recv.Allocate(8).ok());
  absl::Status waited;
  std::thread rank0([&] {
    const ExpertComm::Gather g[] = {{send.get(), recv.get(), 4 * sizeof(float)}};
    waited = (*comms)[0]->AllGather(g, nullptr);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  (*comms)[1]->Abort();  // rank 1 never comes; any rank's Abort ends the group
  rank0.join();
  EXPECT_TRUE(absl::IsAborted(waited)) << waited;
  EXPECT_TRUE(absl::IsAborted((*comms)[0]->ReduceScatterSum(send.get(), recv.get(), 2, nullptr)));
}

TEST(LocalCommTest, RefusesBadDevices) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(absl::IsInvalidArgument(CreateLocalComms({}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(CreateLocalComms({0, DeviceCount()}).status()));
}

#ifdef PDSERVE_HAVE_NCCL
TEST(NcclCommTest, TwoRanksOnTwoGpusGatherAndReduceExactly) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  if (!NcclVersion().ok()) GTEST_SKIP() << NcclVersion().status();
  auto comms = CreateNcclComms({0, 1});
  ASSERT_TRUE(comms.ok()) << comms.status();
  EXPECT_TRUE((*comms)[0]->graph_capturable());
  ExpectCollectiveValues(*comms);
}

TEST(NcclCommTest, RefusesTwoRanksOnOneGpu) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  if (!NcclVersion().ok()) GTEST_SKIP() << NcclVersion().status();
  EXPECT_TRUE(absl::IsInvalidArgument(CreateNcclComms({0, 0}).status()));
}
#endif

GpuModelOptions Options(const TestModel& m, int64_t slots) {
  GpuModelOptions options;
  options.slots = slots;
  options.max_chunk = 512;
  options.max_context = std::min<int64_t>(m.config.max_position_embeddings, 512);
  return options;
}

std::unique_ptr<GpuModelGroup> MakeGroup(const TestModel& m, std::vector<int> devices,
                                         ExpertCommKind comm, int64_t slots) {
  GpuGroupOptions options;
  options.devices = std::move(devices);
  options.comm = comm;
  options.model = Options(m, slots);
  auto group = GpuModelGroup::Create(m.config, m.weights, options);
  EXPECT_TRUE(group.ok()) << group.status();
  return group.ok() ? std::move(*group) : nullptr;
}

Tensor Rows(const Tensor& t, int64_t first, int64_t n) {
  Tensor out({n, t.dim(1)});
  std::copy_n(t.ptr() + first * t.dim(1), n * t.dim(1), out.ptr());
  return out;
}

// Padding rows and idle calls (what a rank does to meet its group's collectives) leave the real
// rows alone: a padded Forward's logits equal the unpadded ones within bf16 noise, and decode
// steps after Idle calls equal those without them bit for bit.
TEST(GpuModelPaddingTest, PaddedForwardAndIdleLeaveTheRealRowsAlone) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  TestModel m;
  LoadByName("kjv-v4-tiny", &m);
  auto make = [&] {
    auto gpu = GpuModel::Create(m.config, m.weights, Options(m, 4));
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    return gpu.ok() ? std::move(*gpu) : nullptr;
  };
  auto a = make();
  auto b = make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t>& prompt = m.prompts[0];
  auto plain = a->Forward(0, prompt);
  auto padded = b->Forward(0, prompt, static_cast<int64_t>(prompt.size()) + 37);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(padded.ok()) << padded.status();
  ASSERT_EQ(padded->dim(0), static_cast<int64_t>(prompt.size()));
  RowStats stats;
  stats.Add(*padded, *plain, 0);
  std::cout << "padded vs plain forward: " << stats.Summary(1e-3) << "\n";
  EXPECT_EQ(stats.ArgmaxRate(), 1.0);
  EXPECT_LE(stats.Worst(), 1e-2);
  ASSERT_TRUE(b->Idle(5).ok());
  ASSERT_TRUE(b->Idle(1).ok());
  auto empty = b->DecodeStep({}, {}, /*use_graph=*/false, /*group_rows=*/2);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->dim(0), 0);
  // Bring a's slot 0 to the same state as b's (the same padded call), then decode both.
  ASSERT_TRUE(a->ResetSlot(0).ok());
  ASSERT_TRUE(a->Forward(0, prompt, static_cast<int64_t>(prompt.size()) + 37).ok());
  int32_t token = 7;
  for (int step = 0; step < 5; ++step) {
    auto x = a->DecodeStep({0}, {token}, /*use_graph=*/true);
    auto y = b->DecodeStep({0}, {token}, /*use_graph=*/true);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(std::memcmp(x->ptr(), y->ptr(), x->data.size() * sizeof(float)), 0) << step;
    token = static_cast<int32_t>(Argmax(x->ptr(), x->dim(1)));
  }
  EXPECT_TRUE(absl::IsInvalidArgument(b->Idle(0)));
  EXPECT_TRUE(absl::IsInvalidArgument(b->Idle(100000)));
  EXPECT_TRUE(absl::IsInvalidArgument(b->DecodeStep({}, {}, false).status()));
}

// The comparison of a group with a 1-rank model on one model's prompts: prompt i belongs to rank
// i % world. Phase 1: whole prompts, one per rank per lock-step round (padded to the round's
// longest). Phase 2: the first half of each prompt as one Forward per prompt in rounds, then
// batched decode steps through the rest, each rank decoding its own prompts (so batch sizes
// differ between ranks and shrink as prompts end), then 8 greedy tokens past each prompt. The
// reference runs the same calls unpadded on one model with every expert.
struct GroupComparison {
  RowStats logits;
  int64_t greedy_equal = 0;
  int64_t greedy_total = 0;
};

GroupComparison CompareGroup(const TestModel& m, GpuModelGroup& group, GpuModel& ref,
                             bool use_graph) {
  GroupComparison out;
  const int64_t world = group.world();
  const auto n = static_cast<int64_t>(m.prompts.size());
  auto rank_of = [&](int64_t i) { return i % world; };
  std::vector<Tensor> refs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(ref.ResetSlot(0).ok());
    auto logits = ref.Forward(0, m.prompts[static_cast<size_t>(i)]);
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (logits.ok()) refs[static_cast<size_t>(i)] = std::move(*logits);
  }
  // Phase 1.
  for (int64_t first = 0; first < n; first += world) {
    int64_t rows = 0;
    for (int64_t i = first; i < std::min(n, first + world); ++i) {
      rows =
          std::max<int64_t>(rows, static_cast<int64_t>(m.prompts[static_cast<size_t>(i)].size()));
    }
    std::vector<Tensor> got(static_cast<size_t>(world));
    const auto ran = group.Run([&](int64_t r, GpuModel& gpu) -> absl::Status {
      const int64_t i = first + r;
      if (i >= n) return gpu.Idle(rows);
      PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(0));
      PDSERVE_ASSIGN_OR_RETURN(got[static_cast<size_t>(r)],
                               gpu.Forward(0, m.prompts[static_cast<size_t>(i)], rows));
      return absl::OkStatus();
    });
    for (const absl::Status& s : ran) EXPECT_TRUE(s.ok()) << s;
    for (int64_t i = first; i < std::min(n, first + world); ++i) {
      out.logits.Add(got[static_cast<size_t>(i - first)], refs[static_cast<size_t>(i)], 0);
    }
  }
  // Phase 2: prompt i in slot 1 + i / world of its rank, and slot 1 + i of the reference.
  const int64_t slots_needed = 1 + (n + world - 1) / world;
  EXPECT_LE(slots_needed, group.rank(0).slots());
  EXPECT_LE(1 + n, ref.slots());
  std::vector<std::vector<int64_t>> mine(static_cast<size_t>(world));
  for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(rank_of(i))].push_back(i);
  auto slot_of = [&](int64_t i) { return 1 + i / world; };
  std::vector<int64_t> next(static_cast<size_t>(n));
  std::vector<std::vector<int32_t>> text(m.prompts.begin(), m.prompts.end());
  std::vector<std::vector<int32_t>> ref_text = text;
  std::vector<int64_t> stop(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    stop[static_cast<size_t>(i)] = static_cast<int64_t>(text[static_cast<size_t>(i)].size()) + 8;
  }
  for (size_t round = 0; round < mine[0].size(); ++round) {
    int64_t rows = 0;
    for (const auto& list : mine) {
      if (round < list.size()) {
        rows = std::max<int64_t>(
            rows, std::max<size_t>(1, m.prompts[static_cast<size_t>(list[round])].size() / 2));
      }
    }
    std::vector<Tensor> got(static_cast<size_t>(world));
    const auto ran = group.Run([&](int64_t r, GpuModel& gpu) -> absl::Status {
      const auto& list = mine[static_cast<size_t>(r)];
      if (round >= list.size()) return gpu.Idle(rows);
      const int64_t i = list[round];
      const auto& tokens = m.prompts[static_cast<size_t>(i)];
      const auto half = static_cast<long>(std::max<size_t>(1, tokens.size() / 2));
      PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(slot_of(i)));
      PDSERVE_ASSIGN_OR_RETURN(
          got[static_cast<size_t>(r)],
          gpu.Forward(slot_of(i), std::vector<int32_t>(tokens.begin(), tokens.begin() + half),
                      rows));
      return absl::OkStatus();
    });
    for (const absl::Status& s : ran) EXPECT_TRUE(s.ok()) << s;
    for (int64_t r = 0; r < world; ++r) {
      const auto& list = mine[static_cast<size_t>(r)];
      if (round >= list.size()) continue;
      const int64_t i = list[round];
      out.logits.Add(got[static_cast<size_t>(r)], refs[static_cast<size_t>(i)], 0);
      next[static_cast<size_t>(i)] = got[static_cast<size_t>(r)].dim(0);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto& tokens = m.prompts[static_cast<size_t>(i)];
    EXPECT_TRUE(ref.ResetSlot(1 + i).ok());
    EXPECT_TRUE(
        ref.Forward(1 + i, std::vector<int32_t>(tokens.begin(),
                                                tokens.begin() + next[static_cast<size_t>(i)]))
            .ok());
  }
  for (;;) {
    std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(world));  // prompt indices
    std::vector<int64_t> sizes(static_cast<size_t>(world), 0);
    for (int64_t i = 0; i < n; ++i) {
      if (next[static_cast<size_t>(i)] >= stop[static_cast<size_t>(i)]) continue;
      rows_of[static_cast<size_t>(rank_of(i))].push_back(i);
      ++sizes[static_cast<size_t>(rank_of(i))];
    }
    const absl::StatusOr<int64_t> rows = GroupDecodeRows(sizes, group.rank(0).decode_buckets());
    EXPECT_TRUE(rows.ok()) << rows.status();
    if (!rows.ok() || *rows == 0) break;
    std::vector<Tensor> got(static_cast<size_t>(world));
    const auto ran = group.Run([&](int64_t r, GpuModel& gpu) -> absl::Status {
      std::vector<int64_t> slots;
      std::vector<int32_t> step;
      for (int64_t i : rows_of[static_cast<size_t>(r)]) {
        slots.push_back(slot_of(i));
        step.push_back(
            text[static_cast<size_t>(i)][static_cast<size_t>(next[static_cast<size_t>(i)])]);
      }
      PDSERVE_ASSIGN_OR_RETURN(got[static_cast<size_t>(r)],
                               gpu.DecodeStep(slots, step, use_graph, *rows));
      return absl::OkStatus();
    });
    for (const absl::Status& s : ran) EXPECT_TRUE(s.ok()) << s;
    std::vector<int64_t> ref_slots;
    std::vector<int32_t> ref_step;
    std::vector<int64_t> order;
    for (int64_t r = 0; r < world; ++r) {
      for (int64_t i : rows_of[static_cast<size_t>(r)]) {
        ref_slots.push_back(1 + i);
        ref_step.push_back(
            ref_text[static_cast<size_t>(i)][static_cast<size_t>(next[static_cast<size_t>(i)])]);
        order.push_back(i);
      }
    }
    auto want = ref.DecodeStep(ref_slots, ref_step, /*use_graph=*/false);
    EXPECT_TRUE(want.ok()) << want.status();
    if (!want.ok() || !ran[0].ok()) break;
    int64_t ref_row = 0;
    for (int64_t r = 0; r < world; ++r) {
      int64_t row = 0;
      for (int64_t i : rows_of[static_cast<size_t>(r)]) {
        const Tensor g = Rows(got[static_cast<size_t>(r)], row++, 1);
        const Tensor w = Rows(*want, ref_row++, 1);
        const int64_t at = next[static_cast<size_t>(i)];
        auto& t = text[static_cast<size_t>(i)];
        auto& rt = ref_text[static_cast<size_t>(i)];
        if (at + 1 < static_cast<int64_t>(m.prompts[static_cast<size_t>(i)].size())) {
          out.logits.Add(g, refs[static_cast<size_t>(i)], at);
        } else {
          // Past the prompt: each side continues greedily from its own logits.
          t.push_back(static_cast<int32_t>(Argmax(g.ptr(), g.dim(1))));
          rt.push_back(static_cast<int32_t>(Argmax(w.ptr(), w.dim(1))));
          ++out.greedy_total;
          out.greedy_equal += t.back() == rt.back();
        }
        ++next[static_cast<size_t>(i)];
      }
    }
  }
  return out;
}

class ExpertParallelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    LoadByName(GetParam(), &model_);
  }
  TestModel model_;
};

// Two ranks on GPU 0 through the in-process communicator against one model with every expert,
// both bf16 production path: argmax agreement >= 99% over every row and greedy tokens equal (the
// only differences are the order of fp32 additions in the MoE sum and GEMMs over padded row
// counts). Measured figures are printed.
TEST_P(ExpertParallelTest, TwoRanksOnOneGpuMatchOneRank) {
  auto group = MakeGroup(model_, {0, 0}, ExpertCommKind::kLocal, 8);
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->world(), 2);
  EXPECT_EQ(group->rank(1).rank(), 1);
  auto ref = GpuModel::Create(model_.config, model_.weights, Options(model_, 12));
  ASSERT_TRUE(ref.ok()) << ref.status();
  const GroupComparison c = CompareGroup(model_, *group, **ref, /*use_graph=*/true);
  std::cout << GetParam() << ", 2 ranks (local) vs 1 rank: " << c.logits.Summary(1e-2)
            << "; greedy tokens equal " << c.greedy_equal << " / " << c.greedy_total << "\n";
  EXPECT_GT(c.logits.rows(), 0);
  EXPECT_GE(c.logits.ArgmaxRate(), 0.99);
  EXPECT_EQ(c.greedy_equal, c.greedy_total);
  EXPECT_TRUE(group->broken().ok());
}

INSTANTIATE_TEST_SUITE_P(Models, ExpertParallelTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

// Three ranks over the bundled model's 8 experts (3 + 3 + 2): uneven shards.
TEST(ExpertParallelUnevenTest, ThreeRanksWithUnevenShards) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  TestModel m;
  LoadByName("kjv-v4-tiny", &m);
  auto group = MakeGroup(m, {0, 0, 0}, ExpertCommKind::kLocal, 8);
  ASSERT_NE(group, nullptr);
  auto ref = GpuModel::Create(m.config, m.weights, Options(m, 12));
  ASSERT_TRUE(ref.ok()) << ref.status();
  const GroupComparison c = CompareGroup(m, *group, **ref, /*use_graph=*/false);
  std::cout << "kjv-v4-tiny, 3 ranks (local) vs 1 rank: " << c.logits.Summary(1e-2)
            << "; greedy tokens equal " << c.greedy_equal << " / " << c.greedy_total << "\n";
  EXPECT_GE(c.logits.ArgmaxRate(), 0.99);
  EXPECT_EQ(c.greedy_equal, c.greedy_total);
}

// A rank whose call fails aborts the group: the other rank, waiting in a collective, returns
// instead of hanging, and the group stays broken.
TEST(ExpertParallelFailureTest, AFailingRankBreaksTheGroupWithoutHanging) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  TestModel m;
  LoadByName("mixed_yarn_f32", &m);
  auto group = MakeGroup(m, {0, 0}, ExpertCommKind::kLocal, 2);
  ASSERT_NE(group, nullptr);
  const auto ran = group->Run([](int64_t r, GpuModel& gpu) -> absl::Status {
    if (r == 1) return gpu.Forward(0, {-1}).status();  // a bad token: fails before any kernel
    return gpu.Forward(0, {1, 2, 3}).status();
  });
  EXPECT_TRUE(absl::IsAborted(ran[0])) << ran[0];
  EXPECT_TRUE(absl::IsInvalidArgument(ran[1])) << ran[1];
  EXPECT_FALSE(group->broken().ok());
  const auto again = group->Run([](int64_t, GpuModel&) { return absl::OkStatus(); });
  EXPECT_FALSE(again[0].ok());
}

TEST(ExpertParallelRefusalTest, RefusesGroupsItCannotBuild) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  TestModel m;
  LoadByName("mixed_yarn_f32", &m);  // 4 routed experts
  GpuGroupOptions options;
  options.devices = {0, 0, 0, 0, 0};
  options.comm = ExpertCommKind::kLocal;
  options.model = Options(m, 2);
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuModelGroup::Create(m.config, m.weights, options).status()));
  options.devices = {};
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuModelGroup::Create(m.config, m.weights, options).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseExpertCommKind("mpi").status()));
}

#ifdef PDSERVE_HAVE_NCCL
// NCCL on one GPU: a 1-rank communicator still runs the expert-parallel MoE path through NCCL's
// all-gather and reduce-scatter, so this checks those calls and their capture into decode graphs:
// graph decode equals eager decode bit for bit, and both match the model without a communicator.
TEST(NcclExpertParallelTest, OneRankThroughNcclCapturesDecodeGraphs) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  if (!NcclVersion().ok()) GTEST_SKIP() << NcclVersion().status();
  std::cout << "NCCL " << *NcclVersion() << "\n";
  TestModel m;
  LoadByName("kjv-v4-tiny", &m);
  // One communicator per model: a graph replays its captured NCCL calls on its own comm.
  auto eager_comm = CreateNcclComms({0});
  auto graph_comm = CreateNcclComms({0});
  ASSERT_TRUE(eager_comm.ok()) << eager_comm.status();
  ASSERT_TRUE(graph_comm.ok()) << graph_comm.status();
  GpuModelOptions options = Options(m, 4);
  options.expert_comm = (*eager_comm)[0].get();
  auto eager = GpuModel::Create(m.config, m.weights, options);
  options.expert_comm = (*graph_comm)[0].get();
  auto graph = GpuModel::Create(m.config, m.weights, options);
  auto plain = GpuModel::Create(m.config, m.weights, Options(m, 4));
  ASSERT_TRUE(eager.ok() && graph.ok() && plain.ok());
  const std::vector<int32_t>& prompt = m.prompts[1];
  RowStats stats;
  auto want = (*plain)->Forward(0, prompt);
  ASSERT_TRUE(want.ok());
  for (auto* gpu : {&*eager, &*graph}) {
    auto got = (*gpu)->Forward(0, prompt);
    ASSERT_TRUE(got.ok()) << got.status();
    stats.Add(*got, *want, 0);
  }
  int32_t token = 11;
  for (int step = 0; step < 6; ++step) {
    auto x = (*eager)->DecodeStep({0}, {token}, /*use_graph=*/false);
    auto y = (*graph)->DecodeStep({0}, {token}, /*use_graph=*/true);
    auto z = (*plain)->DecodeStep({0}, {token}, /*use_graph=*/true);
    ASSERT_TRUE(x.ok() && y.ok() && z.ok()) << x.status() << y.status() << z.status();
    EXPECT_EQ(std::memcmp(x->ptr(), y->ptr(), x->data.size() * sizeof(float)), 0) << step;
    Tensor ref({static_cast<int64_t>(prompt.size()) + 1, z->dim(1)});
    std::copy_n(z->ptr(), z->dim(1), ref.ptr() + static_cast<int64_t>(prompt.size()) * z->dim(1));
    stats.Add(*x, ref, static_cast<int64_t>(prompt.size()));
    token = static_cast<int32_t>(Argmax(z->ptr(), z->dim(1)));
  }
  std::cout << "1 rank through NCCL vs no communicator: " << stats.Summary(1e-3) << "\n";
  EXPECT_EQ(stats.ArgmaxRate(), 1.0);
}

// The proof on a 2-GPU machine: a 2-rank NCCL group (GPUs 0 and 1, graph decode) against
// the 1-GPU model, on every fixture.
TEST(NcclExpertParallelTest, TwoGpusMatchOneGpu) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  if (!NcclVersion().ok()) GTEST_SKIP() << NcclVersion().status();
  RowStats all;
  for (const std::string& name : ModelNames()) {
    TestModel m;
    LoadByName(name, &m);
    auto group = MakeGroup(m, {0, 1}, ExpertCommKind::kNccl, 8);
    ASSERT_NE(group, nullptr);
    auto ref = GpuModel::Create(m.config, m.weights, Options(m, 12));
    ASSERT_TRUE(ref.ok()) << ref.status();
    const GroupComparison c = CompareGroup(m, *group, **ref, /*use_graph=*/true);
    std::cout << name << ", 2 GPUs (NCCL) vs 1 GPU: " << c.logits.Summary(1e-2)
              << "; greedy tokens equal " << c.greedy_equal << " / " << c.greedy_total << "\n";
    EXPECT_EQ(c.greedy_equal, c.greedy_total) << name;
    all.Merge(c.logits);
  }
  std::cout << "all fixtures, 2 GPUs (NCCL) vs 1 GPU: " << all.Summary(1e-2) << "\n";
  EXPECT_GE(all.ArgmaxRate(), 0.99);
}
#endif

}  // namespace
}  // namespace pdserve::engine::gpu
