// API keys and TLS on the router's gRPC front, and mutual TLS between the router and a worker
// (docs/security.md), with the certificates of tools/make_test_certs.sh.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/api_keys.h"
#include "common/tls_credentials.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"
#include "router/grpc_front.h"
#include "router/worker_pool.h"

namespace pdserve::router {
namespace {

namespace pv1 = pdserve::v1;
namespace wv1 = pdserve::worker::v1;

const std::string kTls = PDSERVE_TLS_FIXTURES;

// One delta per request; counts the requests that reached Start.
class CountingService : public frontend::GenerationService {
 public:
  std::atomic<int> starts{0};
  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  frontend::StartResult Start(const frontend::ApiRequest&,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    starts++;
    sink->OnDelta({0, "amen", {}, std::string("stop")});
    sink->OnComplete({1, 1});
    return std::unique_ptr<frontend::Generation>(new NoGeneration());
  }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }

 private:
  struct NoGeneration : frontend::Generation {
    void Cancel() override {}
  };
};

config::SecurityConfig Cluster(const std::string& ca, const std::string& cert) {
  config::SecurityConfig s;
  s.cluster_ca_file = absl::StrCat(kTls, "/", ca, ".pem");
  s.cluster_cert_file = absl::StrCat(kTls, "/", cert, ".pem");
  s.cluster_key_file = absl::StrCat(kTls, "/", cert, ".key");
  return s;
}

grpc::Status Generate(pv1::Generation::Stub& stub, const std::string& authorization) {
  grpc::ClientContext context;
  if (!authorization.empty()) context.AddMetadata("authorization", authorization);
  pv1::GenerateRequest request;
  request.set_model("tiny");
  request.set_text("In the");
  auto reader = stub.Generate(&context, request);
  pv1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  return reader->Finish();
}

std::unique_ptr<pv1::Generation::Stub> Stub(int port,
                                            std::shared_ptr<grpc::ChannelCredentials> creds) {
  grpc::ChannelArguments args;
  args.SetInt("grpc.use_local_subchannel_pool", 1);
  return pv1::Generation::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), creds, args));
}

TEST(GrpcFrontApiKeyTest, CallsWithoutTheKeyAreUnauthenticatedAndStartNothing) {
  CountingService service;
  auto keys = common::ApiKeys::FromText("sk-grpc\n", "keys");
  ASSERT_TRUE(keys.ok());
  auto front = GrpcFront::Start("127.0.0.1", 0, &service, nullptr, *keys);
  ASSERT_TRUE(front.ok()) << front.status();
  auto stub = Stub((*front)->port(), grpc::InsecureChannelCredentials());
  for (const std::string auth : {"", "Bearer sk-nope", "sk-grpc"}) {
    const grpc::Status status = Generate(*stub, auth);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << auth;
    EXPECT_NE(status.error_message().find("invalid_api_key"), std::string::npos);
  }
  grpc::ClientContext context;
  pv1::ListModelsResponse models;
  EXPECT_EQ(stub->ListModels(&context, {}, &models).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(service.starts.load(), 0);

  EXPECT_TRUE(Generate(*stub, "Bearer sk-grpc").ok());
  EXPECT_EQ(service.starts.load(), 1);
  (*front)->Stop();
}

TEST(GrpcFrontTlsTest, ServesTlsClientsAndRefusesPlaintext) {
  CountingService service;
  config::SecurityConfig security;
  security.tls_cert_file = kTls + "/cluster.pem";
  security.tls_key_file = kTls + "/cluster.key";
  auto credentials = common::FrontServerCredentials(security);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  auto front = GrpcFront::Start("127.0.0.1", 0, &service, *credentials);
  ASSERT_TRUE(front.ok()) << front.status();

  grpc::SslCredentialsOptions trust;
  auto ca = common::ReadPemFile(kTls + "/ca.pem", "ca");
  ASSERT_TRUE(ca.ok());
  trust.pem_root_certs = *ca;
  EXPECT_TRUE(Generate(*Stub((*front)->port(), grpc::SslCredentials(trust)), "").ok());
  EXPECT_EQ(Generate(*Stub((*front)->port(), grpc::InsecureChannelCredentials()), "").error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(service.starts.load(), 1);
  (*front)->Stop();
}

// A decode worker's Reserve, counted.
class CountingDecodeWorker final : public wv1::DecodeWorker::Service {
 public:
  std::atomic<int> reserves{0};
  grpc::Status Reserve(grpc::ServerContext*, const wv1::ReserveRequest*,
                       wv1::ReserveResponse*) override {
    reserves++;
    return grpc::Status::OK;
  }
};

class ClusterMtlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto credentials = common::ClusterServerCredentials(Cluster("ca", "cluster"));
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port_);
    builder.RegisterService(&worker_);
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ && port_ > 0);
  }
  void TearDown() override { server_->Shutdown(); }

  grpc::Status Reserve(std::shared_ptr<grpc::ChannelCredentials> credentials) {
    config::WorkerConfig config;
    config.name = "decode-0";
    config.host = "127.0.0.1";
    config.port = port_;
    Worker worker(config, Role::kDecode, 3, std::move(credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    wv1::ReserveResponse response;
    return worker.decode()->Reserve(&context, wv1::ReserveRequest(), &response);
  }

  CountingDecodeWorker worker_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(ClusterMtlsTest, TheRouterWithTheClusterCertificateIsServed) {
  auto credentials = common::ClusterChannelCredentials(Cluster("ca", "cluster"));
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_TRUE(Reserve(*credentials).ok());
  EXPECT_EQ(worker_.reserves.load(), 1);
}

TEST_F(ClusterMtlsTest, APlainCallerNeverReachesReserve) {
  EXPECT_EQ(Reserve(grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(worker_.reserves.load(), 0);
}

TEST_F(ClusterMtlsTest, ACallerWithAnotherCasCertificateNeverReachesReserve) {
  // It trusts the worker (the cluster's CA) but presents a certificate the worker's CA did not
  // sign.
  config::SecurityConfig rogue = Cluster("ca", "rogue");
  auto credentials = common::ClusterChannelCredentials(rogue);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_EQ(Reserve(*credentials).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(worker_.reserves.load(), 0);
}

TEST_F(ClusterMtlsTest, TlsWithoutAClientCertificateNeverReachesReserve) {
  grpc::SslCredentialsOptions trust_only;
  auto ca = common::ReadPemFile(kTls + "/ca.pem", "ca");
  ASSERT_TRUE(ca.ok());
  trust_only.pem_root_certs = *ca;
  EXPECT_EQ(Reserve(grpc::SslCredentials(trust_only)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(worker_.reserves.load(), 0);
}

}  // namespace
}  // namespace pdserve::router
