// rpc::ApplyConnectionLimits and rpc::ServerDrain (common/grpc_listener.h) on real gRPC servers
// over loopback: a drain frees the port at once while the call in flight finishes, a live
// listener's port cannot be shared, and the handshake and idle limits close connections that do
// nothing. Waits are bounded generously (a loaded 2-core machine) and only bound a failing run:
// what is asserted is the outcome, never how long it took.
#include "common/grpc_listener.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"

namespace pdserve::rpc {
namespace {

namespace wv1 = pdserve::worker::v1;

constexpr absl::Duration kBound = absl::Seconds(60);  // bounds a failing run only

// A PrefillWorker whose Health answers with `name` as the model, at once or, with `hold`, when
// the test calls Release() (or CANCELLED when the call is cancelled first).
class HealthService final : public wv1::PrefillWorker::CallbackService {
 public:
  HealthService(std::string name, bool hold) : name_(std::move(name)), hold_(hold) {}

  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* context, const wv1::HealthRequest*,
                                   wv1::HealthResponse* response) override {
    response->set_model(name_);
    if (!hold_) {
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(grpc::Status::OK);
      return reactor;
    }
    auto* reactor = new HeldReactor(this);
    absl::MutexLock lock(&mu_);
    held_ = reactor;
    if (!arrived_.HasBeenNotified()) arrived_.Notify();
    return reactor;
  }

  bool WaitForCall() { return arrived_.WaitForNotificationWithTimeout(kBound); }
  void Release() { FinishHeld(nullptr, grpc::Status::OK); }
  int cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  class HeldReactor final : public grpc::ServerUnaryReactor {
   public:
    explicit HeldReactor(HealthService* service) : service_(service) {}
    void OnCancel() override {
      service_->FinishHeld(this, grpc::Status::CANCELLED);
      absl::MutexLock lock(&service_->mu_);
      ++service_->cancelled_;
    }
    void OnDone() override { delete this; }

   private:
    HealthService* const service_;
  };

  // Finishes the held call once (`which` null: whichever is held).
  void FinishHeld(HeldReactor* which, const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (held_ == nullptr || (which != nullptr && which != held_)) return;
    held_->Finish(status);
    held_ = nullptr;
  }

  const std::string name_;
  const bool hold_;
  absl::Mutex mu_;
  HeldReactor* held_ ABSL_GUARDED_BY(mu_) = nullptr;
  int cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification arrived_;
};

// A server of `service` on 127.0.0.1:`port` (0: a free one) with `limits`; null when it cannot
// bind. `*bound` is the port it got.
std::unique_ptr<grpc::Server> Serve(grpc::Service* service, int port,
                                    const config::GrpcConfig& limits, int* bound) {
  grpc::ServerBuilder builder;
  ApplyConnectionLimits(limits, builder);
  builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                           bound);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (*bound == 0) return nullptr;
  return server;
}

std::shared_ptr<grpc::Channel> Connect(int port) {
  // Its own connection, not one shared with the test's other channels.
  grpc::ChannelArguments args;
  args.SetInt("grpc.use_local_subchannel_pool", 1);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

// Health's model on a new connection to `port`, or the failed status' message.
std::string AskWho(int port) {
  auto stub = wv1::PrefillWorker::NewStub(Connect(port));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kBound));
  wv1::HealthResponse response;
  const grpc::Status status = stub->Health(&context, wv1::HealthRequest(), &response);
  return status.ok() ? response.model() : "failed: " + status.error_message();
}

// One Health call, started on `channel` when constructed; its answer arrives on a gRPC thread.
class PendingCall {
 public:
  explicit PendingCall(const std::shared_ptr<grpc::Channel>& channel)
      : stub_(wv1::PrefillWorker::NewStub(channel)) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + kBound));
    stub_->async()->Health(&context_, &request_, &response_, [this](grpc::Status status) {
      status_ = std::move(status);
      done_.Notify();
    });
  }
  // The callback uses this object; its deadline bounds the wait in a failing run.
  ~PendingCall() { done_.WaitForNotificationWithTimeout(kBound + absl::Seconds(5)); }

  bool Wait() { return done_.WaitForNotificationWithTimeout(kBound); }
  bool Done() const { return done_.HasBeenNotified(); }
  // After Wait() returned true.
  const grpc::Status& status() const { return status_; }
  const wv1::HealthResponse& response() const { return response_; }

 private:
  std::unique_ptr<wv1::PrefillWorker::Stub> stub_;
  grpc::ClientContext context_;
  const wv1::HealthRequest request_;
  wv1::HealthResponse response_;
  grpc::Status status_;
  absl::Notification done_;
};

// A TCP connection to 127.0.0.1:`port` that never sends a byte; -1 when it cannot connect.
int ConnectRaw(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// A replacement process binds the port of one that is draining, and new connections reach it,
// while the draining server's call in flight (and a connection that never finished its
// handshake) are still there; that call then completes normally.
TEST(ServerDrainTest, FreesThePortWhileTheCallInFlightFinishes) {
  HealthService old_service("old", /*hold=*/true);
  int port = 0;
  std::unique_ptr<grpc::Server> old_server = Serve(&old_service, 0, {}, &port);
  ASSERT_NE(old_server, nullptr);
  const int silent = ConnectRaw(port);
  ASSERT_GE(silent, 0);

  PendingCall in_flight(Connect(port));
  ASSERT_TRUE(old_service.WaitForCall());

  ServerDrain drain(old_server.get());
  HealthService new_service("new", /*hold=*/false);
  int new_port = 0;
  std::unique_ptr<grpc::Server> new_server = Serve(&new_service, port, {}, &new_port);
  ASSERT_NE(new_server, nullptr) << "the draining server still holds port " << port;
  EXPECT_EQ(new_port, port);
  EXPECT_EQ(AskWho(port), "new");
  EXPECT_FALSE(in_flight.Done());

  old_service.Release();
  ASSERT_TRUE(in_flight.Wait());
  EXPECT_TRUE(in_flight.status().ok()) << in_flight.status().error_message();
  EXPECT_EQ(in_flight.response().model(), "old");
  close(silent);  // (a connection still in its handshake holds the shutdown up to its timeout)
  drain.Finish(kBound);
  new_server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

// A call still running when the grace ends is cancelled (the handler sees it), and Finish
// returns.
TEST(ServerDrainTest, FinishCancelsWhatOutlivesTheGrace) {
  HealthService service("held", /*hold=*/true);
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&service, 0, {}, &port);
  ASSERT_NE(server, nullptr);
  PendingCall call(Connect(port));
  ASSERT_TRUE(service.WaitForCall());
  {
    ServerDrain drain(server.get());
    drain.Finish(absl::Milliseconds(100));
  }
  ASSERT_TRUE(call.Wait());
  EXPECT_FALSE(call.status().ok());
  EXPECT_EQ(service.cancelled(), 1);
}

// No SO_REUSEPORT: while one server listens, a second one on its port fails to bind.
TEST(ConnectionLimitsTest, ALiveListenersPortIsNotShared) {
  HealthService service("first", /*hold=*/false);
  int port = 0;
  std::unique_ptr<grpc::Server> first = Serve(&service, 0, {}, &port);
  ASSERT_NE(first, nullptr);
  HealthService other("second", /*hold=*/false);
  int second_port = 0;
  EXPECT_EQ(Serve(&other, port, {}, &second_port), nullptr);
  EXPECT_EQ(second_port, 0);
  EXPECT_EQ(AskWho(port), "first");
  first->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

// A connection that never sends its HTTP/2 preface is closed after handshake_timeout_ms (gRPC's
// own default would hold it 120 s, longer than the 60 s this waits).
TEST(ConnectionLimitsTest, ASilentConnectionIsClosedAfterTheHandshakeTimeout) {
  HealthService service("s", /*hold=*/false);
  config::GrpcConfig limits;
  limits.handshake_timeout_ms = 1000;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&service, 0, limits, &port);
  ASSERT_NE(server, nullptr);
  const int fd = ConnectRaw(port);
  ASSERT_GE(fd, 0);
  timeval timeout{};
  timeout.tv_sec = absl::ToInt64Seconds(kBound);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  // The server's HTTP/2 settings come first; then the end of stream or a reset. A timeout
  // (EAGAIN) means the connection was held.
  char bytes[256];
  ssize_t got = 0;
  int error = 0;
  const absl::Time give_up = absl::Now() + kBound;
  do {
    got = recv(fd, bytes, sizeof(bytes), 0);
    error = errno;
  } while (got > 0 && absl::Now() < give_up);
  EXPECT_TRUE(got == 0 || (got < 0 && error == ECONNRESET)) << "recv " << got << " errno " << error;
  close(fd);
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

// A connection with no call for max_connection_idle_ms is closed (the client's channel leaves
// READY, to IDLE, and its next call connects again); one with a call in flight longer than that
// is not.
TEST(ConnectionLimitsTest, AnIdleConnectionIsClosedAndABusyOneIsNot) {
  HealthService held("held", /*hold=*/true);
  config::GrpcConfig limits;
  limits.max_connection_idle_ms = 1000;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&held, 0, limits, &port);
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = Connect(port);
  PendingCall call(channel);
  ASSERT_TRUE(held.WaitForCall());
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  // Three idle limits with the call open: the connection stays.
  EXPECT_FALSE(channel->WaitForStateChange(GRPC_CHANNEL_READY,
                                           absl::ToChronoTime(absl::Now() + absl::Seconds(3))));
  held.Release();
  ASSERT_TRUE(call.Wait());
  EXPECT_TRUE(call.status().ok()) << call.status().error_message();
  // No call now: the server closes it.
  ASSERT_TRUE(
      channel->WaitForStateChange(GRPC_CHANNEL_READY, absl::ToChronoTime(absl::Now() + kBound)));
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_IDLE);
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

// Past max_connection_age and its grace the connection closes under a call still open: the
// client's call ends UNAVAILABLE (what the router reads as a worker that is down,
// router/request.h WorkerDown), the server's is cancelled.
TEST(ConnectionLimitsTest, TheAgeGraceCutsACallStillOpen) {
  HealthService held("held", /*hold=*/true);
  config::GrpcConfig limits;
  limits.max_connection_age_ms = 1000;
  limits.max_connection_age_grace_ms = 1000;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(&held, 0, limits, &port);
  ASSERT_NE(server, nullptr);
  PendingCall call(Connect(port));
  ASSERT_TRUE(held.WaitForCall());
  ASSERT_TRUE(call.Wait());
  EXPECT_EQ(call.status().error_code(), grpc::StatusCode::UNAVAILABLE)
      << call.status().error_message();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  EXPECT_EQ(held.cancelled(), 1);
}

}  // namespace
}  // namespace pdserve::rpc
