// worker::LoadWorkerEntry and worker::CudaDevices (worker/worker_process.h): a cuda worker with
// several GPUs is one expert-parallel group (no longer refused), its GPUs become devices 0..n-1
// of the process through CUDA_VISIBLE_DEVICES, and NVLink multicast is switched off.
#include "worker/worker_process.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace pdserve::worker {
namespace {

std::string WriteConfig(const std::string& decode_gpus) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("worker_process_test_" + decode_gpus + ".yaml");
  std::ofstream out(path);
  out << "name: t\nmodel:\n  path: models/m\nrouter:\n  http_port: 8000\n"
         "prefill:\n  - name: p0\n    host: 127.0.0.1\n    port: 9100\n    backend: cpu\n"
         "decode:\n  - name: d0\n    host: 127.0.0.1\n    port: 9200\n    backend: cuda\n"
         "    gpus: \""
      << decode_gpus << "\"\n";
  return path.string();
}

TEST(WorkerProcessTest, ACudaWorkerOnTwoGpusIsOneGroup) {
  setenv("NCCL_NVLS_ENABLE", "1", /*overwrite=*/1);
  WorkerFlags flags;
  flags.config_path = WriteConfig("2,3");
  auto entry = LoadWorkerEntry(flags, "decode");
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(entry->worker.gpus, "2,3");
  EXPECT_STREQ(std::getenv("CUDA_VISIBLE_DEVICES"), "2,3");
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  auto devices = CudaDevices(entry->worker);
  ASSERT_TRUE(devices.ok()) << devices.status();
  EXPECT_EQ(*devices, std::vector<int>({0, 1}));
}

TEST(WorkerProcessTest, CudaDevicesOfOneGpuAndOfABadList) {
  config::WorkerConfig worker;
  worker.name = "d0";
  worker.gpus = "5";
  EXPECT_EQ(*CudaDevices(worker), std::vector<int>({0}));
  worker.gpus = "1,1";
  const absl::StatusOr<std::vector<int>> twice = CudaDevices(worker);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("names GPU 1 twice"), std::string::npos)
      << twice.status();
}

// Every client that hangs up cancels its Prefill: routine, logged at debug (the failures metric
// counts it); a failure the caller did not ask for stays a warning.
TEST(WorkerProcessTest, CancellationsLogAtDebugAndRealFailuresWarn) {
  const absl::Status aborted = absl::CancelledError("request 7 was aborted");
  EXPECT_EQ(FailureLogLevel(aborted, /*cancelled_by_caller=*/true), spdlog::level::debug);
  // CANCELLED that the caller did not ask for (a transport cancelled a send) is a failure.
  EXPECT_EQ(FailureLogLevel(aborted, /*cancelled_by_caller=*/false), spdlog::level::warn);
  EXPECT_EQ(FailureLogLevel(absl::UnavailableError("peer lost"), /*cancelled_by_caller=*/true),
            spdlog::level::warn);
  EXPECT_EQ(FailureLogLevel(absl::InvalidArgumentError("x"), /*cancelled_by_caller=*/false),
            spdlog::level::warn);
}

}  // namespace
}  // namespace pdserve::worker
