#include "common/tls_credentials.h"

#include <gtest/gtest.h>

#include <string>

namespace pdserve::common {
namespace {

const std::string kTls = PDSERVE_TLS_FIXTURES;

config::SecurityConfig Cluster(const std::string& ca, const std::string& cert) {
  config::SecurityConfig s;
  s.cluster_ca_file = kTls + "/" + ca + ".pem";
  s.cluster_cert_file = kTls + "/" + cert + ".pem";
  s.cluster_key_file = kTls + "/" + cert + ".key";
  return s;
}

TEST(TlsCredentialsTest, ReadsTheConfiguredPemFiles) {
  EXPECT_TRUE(ClusterServerCredentials(Cluster("ca", "cluster")).ok());
  EXPECT_TRUE(ClusterChannelCredentials(Cluster("ca", "cluster")).ok());
  config::SecurityConfig front;
  front.tls_cert_file = kTls + "/cluster.pem";
  front.tls_key_file = kTls + "/cluster.key";
  EXPECT_TRUE(FrontServerCredentials(front).ok());
}

TEST(TlsCredentialsTest, AMissingFileNamesTheSetting) {
  config::SecurityConfig s = Cluster("ca", "cluster");
  s.cluster_key_file = kTls + "/absent.key";
  auto credentials = ClusterServerCredentials(s);
  ASSERT_FALSE(credentials.ok());
  EXPECT_EQ(credentials.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(credentials.status().message().find("security.cluster_tls.key_file"),
            std::string::npos);
}

TEST(TlsCredentialsTest, AFileWithoutPemIsRefused) {
  auto pem = ReadPemFile(std::string(PDSERVE_TLS_FIXTURES) + "/../../CMakeLists.txt", "ca");
  ASSERT_FALSE(pem.ok());
  EXPECT_EQ(pem.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::common
