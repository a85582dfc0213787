#include "common/tls_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::common {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " holds no PEM block"));
  }
  return text.str();
}

namespace {

// The PEM key and certificate chain named by `<setting>.cert_file` / `<setting>.key_file`.
absl::StatusOr<grpc::SslServerCredentialsOptions::PemKeyCertPair> KeyCertPair(
    const std::string& cert_file, const std::string& key_file, const std::string& setting) {
  PDSERVE_ASSIGN_OR_RETURN(std::string cert, ReadPemFile(cert_file, setting + ".cert_file"));
  PDSERVE_ASSIGN_OR_RETURN(std::string key, ReadPemFile(key_file, setting + ".key_file"));
  return grpc::SslServerCredentialsOptions::PemKeyCertPair{std::move(key), std::move(cert)};
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> FrontServerCredentials(
    const config::SecurityConfig& security) {
  if (!security.front_tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  PDSERVE_ASSIGN_OR_RETURN(
      auto pair, KeyCertPair(security.tls_cert_file, security.tls_key_file, "security.tls"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ClusterServerCredentials(
    const config::SecurityConfig& security) {
  if (!security.cluster_tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  PDSERVE_ASSIGN_OR_RETURN(options.pem_root_certs,
                           ReadPemFile(security.cluster_ca_file, "security.cluster_tls.ca_file"));
  PDSERVE_ASSIGN_OR_RETURN(
      auto pair,
      KeyCertPair(security.cluster_cert_file, security.cluster_key_file, "security.cluster_tls"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClusterChannelCredentials(
    const config::SecurityConfig& security) {
  if (!security.cluster_tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  PDSERVE_ASSIGN_OR_RETURN(options.pem_root_certs,
                           ReadPemFile(security.cluster_ca_file, "security.cluster_tls.ca_file"));
  PDSERVE_ASSIGN_OR_RETURN(
      auto pair,
      KeyCertPair(security.cluster_cert_file, security.cluster_key_file, "security.cluster_tls"));
  options.pem_cert_chain = std::move(pair.cert_chain);
  options.pem_private_key = std::move(pair.private_key);
  return grpc::SslCredentials(options);
}

}  // namespace pdserve::common
