// gRPC credentials from a deployment's security settings (docs/security.md): the router's front
// (TLS), the workers' servers and the router's channels to them (mutual TLS with the cluster's
// CA). Insecure credentials where the deployment configures none (the default on loopback).
//
// Errors: NotFound naming the file when a configured PEM file cannot be read, InvalidArgument when
// it holds no PEM block. The files are read once, when the caller builds its server or channel.
// Thread-safe: pure functions of their arguments and the files.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/deploy_config.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace pdserve::common {

// Reads a PEM file whole. Errors as above; `what` ("security.tls.cert_file") names the setting.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what);

// The router's gRPC front: TLS with tls_cert_file / tls_key_file, else insecure.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> FrontServerCredentials(
    const config::SecurityConfig& security);

// A worker's gRPC server: mutual TLS (a client certificate signed by cluster_ca_file is required
// and verified), else insecure.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ClusterServerCredentials(
    const config::SecurityConfig& security);

// The router's channels to the workers: TLS verifying the worker against cluster_ca_file and
// presenting the cluster certificate, else insecure.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClusterChannelCredentials(
    const config::SecurityConfig& security);

}  // namespace pdserve::common
