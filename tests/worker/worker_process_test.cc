// worker::LoadWorkerEntry and worker::CudaDevices (worker/worker_process.h): a cuda worker with
// several GPUs is one expert-parallel group (no longer refused), its GPUs become devices 0..n-1
// of the process through CUDA_VISIBLE_DEVICES, and NVLink multicast is switched off. RunWorker's
// drain: the worker turns DRAINING while its port is still bound.
#include "worker/worker_process.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"

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

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

// A port that was free a moment ago.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = Loopback(0);
  socklen_t size = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), size);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size);
  close(fd);
  return ntohs(addr.sin_port);
}

// Whether a replacement process could bind 127.0.0.1:`port` now (SO_REUSEADDR, as gRPC's
// listeners set it: only a socket still listening there refuses it).
bool CanBind(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in addr = Loopback(port);
  const bool bound = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return bound;
}

bool Listening(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in addr = Loopback(port);
  const bool connected = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return connected;
}

// A Reserve or Prefill that the server takes in the instant it stops listening must find the
// worker DRAINING (UNAVAILABLE, retried elsewhere), not start work whose next call (Generate)
// would go to a replacement on the port: hooks.draining runs while the port is still held,
// hooks.stopping once it is free.
TEST(WorkerProcessTest, TheWorkerTurnsDrainingWhileItsPortIsStillBound) {
  WorkerEntry entry;
  entry.worker.name = "d0";
  entry.worker.host = "127.0.0.1";
  entry.worker.port = FreePort();
  entry.worker.metrics_port = 0;
  const int port = entry.worker.port;
  v1::DecodeWorker::Service service;  // every method UNIMPLEMENTED: only the process is tested
  std::vector<std::string> seen;      // written by the worker's thread, read after its join
  WorkerHooks hooks;
  hooks.draining = [&] { seen.push_back(CanBind(port) ? "draining: free" : "draining: held"); };
  hooks.stopping = [&](absl::Duration) {
    seen.push_back(CanBind(port) ? "stopping: free" : "stopping: held");
  };
  absl::Status status;
  std::thread worker([&] {
    BlockStopSignals();  // the SIGTERM below is this thread's, for RunWorker's sigwait
    status = RunWorker(entry, "decode", &service, v1::DecodeWorker::service_full_name(), hooks,
                       /*drain_timeout_ms=*/1000);
  });
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (!Listening(port) && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  const bool served = Listening(port);
  pthread_kill(worker.native_handle(), SIGTERM);
  worker.join();
  ASSERT_TRUE(served) << "never listened on " << port << ": " << status;
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(seen, std::vector<std::string>({"draining: held", "stopping: free"}));
}

}  // namespace
}  // namespace pdserve::worker
