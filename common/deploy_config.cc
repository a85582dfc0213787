#include "common/deploy_config.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/regular_file.h"
#include "yaml-cpp/yaml.h"

namespace pdserve::config {
namespace {

const std::set<std::string> kPolicies = {"round_robin", "least_load", "power_of_two",
                                         "prefix_aware"};
const std::set<std::string> kBackends = {"cpu", "cuda"};
// The workers move state pages over UCX only (UCX_TLS picks tcp, shared memory, ...).
const std::set<std::string> kTransports = {"ucx"};
const std::set<std::string> kActions = {"flag", "stop"};
const std::set<std::string> kKernels = {"sparse_attention", "indexer", "fp8_state"};

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : absl::StrCat(path, ".", key);
}

// A scalar written in quotes ('31400' or "31400"): yaml-cpp gives it the non-specific tag "!"
// (a plain scalar has "?"). Numbers and booleans are refused quoted, as the JSON API refuses
// "max_tokens": "5": a quoted value is usually a template that did not expand as intended.
bool Quoted(const YAML::Node& v) { return v.IsScalar() && v.Tag() == "!"; }

bool IsHostLabel(absl::string_view label) {
  if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
    return false;
  }
  for (char c : label) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
  }
  return true;
}

bool IsHost(const std::string& host) {
  unsigned char address[sizeof(in6_addr)];
  if (inet_pton(AF_INET, host.c_str(), address) == 1 ||
      inet_pton(AF_INET6, host.c_str(), address) == 1) {
    return true;
  }
  if (host.size() > 253) return false;
  const std::vector<absl::string_view> labels = absl::StrSplit(host, '.');
  for (absl::string_view label : labels) {
    if (!IsHostLabel(label)) return false;
  }
  // An all-digit last label is a mistyped address ("999.1.1.1", "10.0.0"), not a name.
  const absl::string_view last = labels.back();
  return !std::all_of(last.begin(), last.end(),
                      [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); });
}

// Reads typed fields out of YAML maps, recording every problem with its position.
class Reader {
 public:
  Reader(std::string file, std::vector<ConfigError>* errors)
      : file_(std::move(file)), errors_(errors) {}

  void Error(const YAML::Node& at, const std::string& key, std::string message) {
    const YAML::Mark mark = at.Mark();
    Error(mark, key, std::move(message));
  }
  void Error(const YAML::Mark& mark, const std::string& key, std::string message) {
    errors_->push_back({file_, mark.is_null() ? 0 : mark.line + 1,
                        mark.is_null() ? 0 : mark.column + 1, key, std::move(message)});
  }

  // True when `node` is a map; unknown and duplicate keys are reported.
  bool Map(const YAML::Node& node, const std::string& path, const std::set<std::string>& known) {
    if (!node.IsMap()) {
      Error(node, path.empty() ? "(document)" : path, "must be a mapping");
      return false;
    }
    std::set<std::string> seen;
    for (const auto& kv : node) {
      const std::string key = kv.first.Scalar();
      if (!known.count(key)) {
        Error(kv.first.Mark(), Join(path, key),
              absl::StrCat("unknown key (known: ", absl::StrJoin(known, ", "), ")"));
      } else if (!seen.insert(key).second) {
        Error(kv.first.Mark(), Join(path, key), "duplicate key");
      }
    }
    return true;
  }

  // The value of `key`, or a null node: when the key is absent (reported when `required`) or
  // present without a value (`key:` or `key: ~`, always reported: an empty value is not the
  // default, which leaving the key out gives).
  YAML::Node Field(const YAML::Node& map, const std::string& path, const std::string& key,
                   bool required) {
    YAML::Node value = map[key];
    if (!value.IsDefined()) {
      if (required) Error(map, Join(path, key), "required key is missing");
      return YAML::Node(YAML::NodeType::Null);
    }
    if (value.IsNull()) {
      // At the key: an empty value's own mark is where the next token starts (the next line).
      YAML::Mark at = value.Mark();
      for (const auto& kv : map) {
        if (kv.first.IsScalar() && kv.first.Scalar() == key) at = kv.first.Mark();
      }
      Error(at, Join(path, key), "has no value (leave the key out for its default)");
      return YAML::Node(YAML::NodeType::Null);
    }
    return value;
  }

  void String(const YAML::Node& map, const std::string& path, const std::string& key, bool required,
              std::string* out) {
    const YAML::Node v = Field(map, path, key, required);
    if (v.IsNull()) return;
    if (!v.IsScalar() || v.Scalar().empty()) {
      return Error(v, Join(path, key), "must be a non-empty string");
    }
    *out = v.Scalar();
  }

  // A host: an IPv4 or IPv6 address, or a host name (RFC 1123: dot-separated labels of letters,
  // digits and '-', 1-63 characters, not starting or ending with '-'; 253 characters at most; the
  // last label not all digits, so "999.1.1.1" is neither an address nor a name).
  void Host(const YAML::Node& map, const std::string& path, const std::string& key, bool required,
            std::string* out) {
    std::string host;
    String(map, path, key, required, &host);
    if (host.empty()) return;
    if (!IsHost(host)) {
      return Error(map[key], Join(path, key),
                   "must be an IPv4 or IPv6 address or a host name (letters, digits, '-' and '.')");
    }
    *out = host;
  }

  void Enum(const YAML::Node& map, const std::string& path, const std::string& key, bool required,
            const std::set<std::string>& allowed, std::string* out) {
    const YAML::Node v = Field(map, path, key, required);
    if (v.IsNull()) return;
    if (!v.IsScalar() || !allowed.count(v.Scalar())) {
      return Error(v, Join(path, key),
                   absl::StrCat("must be one of: ", absl::StrJoin(allowed, ", ")));
    }
    *out = v.Scalar();
  }

  template <typename T>
  void Int(const YAML::Node& map, const std::string& path, const std::string& key, bool required,
           int64_t min, int64_t max, T* out) {
    const YAML::Node v = Field(map, path, key, required);
    if (v.IsNull()) return;
    int64_t value = 0;
    if (Quoted(v)) {
      return Error(v, Join(path, key),
                   absl::StrCat("must be an integer in [", min, ", ", max,
                                "], not a quoted string (leave out the quotes)"));
    }
    if (!v.IsScalar() || !absl::SimpleAtoi(v.Scalar(), &value) || value < min || value > max) {
      return Error(v, Join(path, key),
                   absl::StrCat("must be an integer in [", min, ", ", max, "]"));
    }
    *out = static_cast<T>(value);
  }

  // An integer that is 0 (no limit) or in [min, max].
  void LimitMs(const YAML::Node& map, const std::string& path, const std::string& key, int min,
               int max, int* out) {
    const YAML::Node v = Field(map, path, key, false);
    if (v.IsNull()) return;
    const std::string allowed =
        absl::StrCat("must be 0 (no limit) or an integer in [", min, ", ", max, "]");
    if (Quoted(v)) {
      return Error(v, Join(path, key),
                   absl::StrCat(allowed, ", not a quoted string (leave out the quotes)"));
    }
    int value = 0;
    if (!v.IsScalar() || !absl::SimpleAtoi(v.Scalar(), &value) || value < 0 || value > max ||
        (value != 0 && value < min)) {
      return Error(v, Join(path, key), allowed);
    }
    *out = value;
  }

  void Double(const YAML::Node& map, const std::string& path, const std::string& key, double min,
              double max, double* out) {
    const YAML::Node v = Field(map, path, key, false);
    if (v.IsNull()) return;
    double value = 0;
    if (Quoted(v)) {
      return Error(v, Join(path, key),
                   absl::StrCat("must be a number in [", min, ", ", max,
                                "], not a quoted string (leave out the quotes)"));
    }
    if (!v.IsScalar() || !absl::SimpleAtod(v.Scalar(), &value) || !(value >= min) ||
        !(value <= max)) {
      return Error(v, Join(path, key), absl::StrCat("must be a number in [", min, ", ", max, "]"));
    }
    *out = value;
  }

  void Bool(const YAML::Node& map, const std::string& path, const std::string& key, bool* out) {
    const YAML::Node v = Field(map, path, key, false);
    if (v.IsNull()) return;
    bool value = false;
    if (Quoted(v) || !v.IsScalar() || !YAML::convert<bool>::decode(v, value)) {
      return Error(v, Join(path, key), "must be true or false");
    }
    *out = value;
  }

 private:
  std::string file_;
  std::vector<ConfigError>* errors_;
};

WorkerConfig ReadWorker(Reader& r, const YAML::Node& node, const std::string& path, bool decode) {
  WorkerConfig w;
  if (!r.Map(node, path,
             {"name", "host", "port", "metrics_port", "backend", "gpus", "threads", "weights",
              "fp8_activations", "state_tokens", "prefill_chunk"})) {
    return w;
  }
  r.String(node, path, "name", true, &w.name);
  r.Host(node, path, "host", true, &w.host);
  r.Int(node, path, "port", true, 1, 65535, &w.port);
  r.Int(node, path, "metrics_port", false, 1, 65535, &w.metrics_port);
  r.Enum(node, path, "backend", true, kBackends, &w.backend);
  r.Int(node, path, "threads", false, 0, 4096, &w.threads);
  r.Enum(node, path, "weights", false, {"bf16", "fp8"}, &w.weights);
  if (w.backend == "cpu" && w.weights != "bf16") {
    r.Error(node["weights"], Join(path, "weights"), "only for backend cuda");
  }
  r.Enum(node, path, "fp8_activations", false, {"bf16", "fp8"}, &w.fp8_activations);
  if (w.weights != "fp8" && node["fp8_activations"].IsDefined()) {
    r.Error(node["fp8_activations"], Join(path, "fp8_activations"), "only with weights: fp8");
  }
  if (node["state_tokens"].IsDefined()) {
    if (!decode) {
      r.Error(node["state_tokens"], Join(path, "state_tokens"), "only for decode workers");
    } else if (w.backend != "cuda") {
      r.Error(node["state_tokens"], Join(path, "state_tokens"), "only for backend cuda");
    } else {
      const YAML::Node v = node["state_tokens"];
      constexpr int64_t kMaxStateTokens = int64_t{1} << 40;
      if (v.IsScalar() && v.Scalar() == "auto") {
        w.state_tokens = kAutoStateTokens;
      } else if (!v.IsScalar() || !absl::SimpleAtoi(v.Scalar(), &w.state_tokens) ||
                 w.state_tokens < 0 || w.state_tokens > kMaxStateTokens) {
        w.state_tokens = 0;
        r.Error(v, Join(path, "state_tokens"),
                absl::StrCat("must be auto or an integer in [0, ", kMaxStateTokens, "]"));
      }
    }
  }
  if (node["prefill_chunk"].IsDefined()) {
    if (decode) {
      r.Error(node["prefill_chunk"], Join(path, "prefill_chunk"), "only for prefill workers");
    } else if (w.backend != "cuda") {
      r.Error(node["prefill_chunk"], Join(path, "prefill_chunk"), "only for backend cuda");
    } else {
      r.Int(node, path, "prefill_chunk", false, kPrefillChunkAlign, kMaxPrefillChunk,
            &w.prefill_chunk);
      if (w.prefill_chunk % kPrefillChunkAlign != 0) {
        r.Error(node["prefill_chunk"], Join(path, "prefill_chunk"),
                absl::StrCat("must be a multiple of ", kPrefillChunkAlign));
        w.prefill_chunk = 0;
      }
    }
  }
  const YAML::Node gpus = r.Field(node, path, "gpus", false);
  if (w.backend == "cuda" && gpus.IsNull()) {
    r.Error(node, Join(path, "gpus"), "required for backend cuda");
  } else if (w.backend == "cpu" && !gpus.IsNull()) {
    r.Error(gpus, Join(path, "gpus"), "not allowed for backend cpu");
  } else if (!gpus.IsNull()) {
    absl::StatusOr<std::vector<int>> ids =
        absl::InvalidArgumentError("must be comma-separated GPU indices, e.g. \"0,1\"");
    if (gpus.IsScalar()) ids = ParseGpuList(gpus.Scalar());
    if (ids.ok()) {
      w.gpus = gpus.Scalar();
    } else {
      r.Error(gpus, Join(path, "gpus"), std::string(ids.status().message()));
    }
  }
  if (w.backend == "cuda" && w.threads != 0) {
    r.Error(node["threads"], Join(path, "threads"), "only for backend cpu");
  }
  return w;
}

std::vector<WorkerConfig> ReadWorkers(Reader& r, const YAML::Node& root, const std::string& key,
                                      std::vector<YAML::Node>* nodes) {
  std::vector<WorkerConfig> out;
  const YAML::Node list = r.Field(root, "", key, true);
  if (list.IsNull()) return out;
  if (!list.IsSequence() || list.size() == 0) {
    r.Error(list, key, "must be a non-empty list of workers");
    return out;
  }
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(ReadWorker(r, list[i], absl::StrCat(key, "[", i, "]"), key == "decode"));
    nodes->push_back(list[i]);
  }
  return out;
}

void ReadRouter(Reader& r, const YAML::Node& node, RouterConfig* c) {
  if (!r.Map(node, "router",
             {"host", "http_port", "grpc_port", "prefill_policy", "decode_policy",
              "health_interval_ms", "health_timeout_ms", "max_body_bytes", "prefill_timeout_ms",
              "queue_timeout_ms", "max_prefills_per_worker", "allow_half_close"})) {
    return;
  }
  r.Host(node, "router", "host", false, &c->host);
  r.Int(node, "router", "http_port", true, 1, 65535, &c->http_port);
  r.Int(node, "router", "grpc_port", false, 1, 65535, &c->grpc_port);
  r.Enum(node, "router", "prefill_policy", false, kPolicies, &c->prefill_policy);
  r.Enum(node, "router", "decode_policy", false, kPolicies, &c->decode_policy);
  r.Int(node, "router", "health_interval_ms", false, 10, 600000, &c->health_interval_ms);
  r.Int(node, "router", "health_timeout_ms", false, 100, 600000, &c->health_timeout_ms);
  r.Int(node, "router", "max_body_bytes", false, 1024, int64_t{1} << 32, &c->max_body_bytes);
  r.Int(node, "router", "prefill_timeout_ms", false, 100, 3600000, &c->prefill_timeout_ms);
  r.Int(node, "router", "queue_timeout_ms", false, 0, 3600000, &c->queue_timeout_ms);
  r.Int(node, "router", "max_prefills_per_worker", false, 0, 1024, &c->max_prefills_per_worker);
  r.Bool(node, "router", "allow_half_close", &c->allow_half_close);
}

void ReadGuards(Reader& r, const YAML::Node& node, GuardsConfig* g) {
  if (!r.Map(node, "guards",
             {"degeneration_action", "paranoid", "canary_every", "canary_tolerance",
              "reference_kernels"})) {
    return;
  }
  r.Enum(node, "guards", "degeneration_action", false, kActions, &g->degeneration_action);
  r.Bool(node, "guards", "paranoid", &g->paranoid);
  r.Int(node, "guards", "canary_every", false, 0, 1000000, &g->canary_every);
  r.Double(node, "guards", "canary_tolerance", 0, 1e6, &g->canary_tolerance);
  const YAML::Node kernels = r.Field(node, "guards", "reference_kernels", false);
  if (kernels.IsNull()) return;
  if (!kernels.IsSequence()) {
    return r.Error(kernels, "guards.reference_kernels", "must be a list");
  }
  for (size_t i = 0; i < kernels.size(); ++i) {
    const std::string path = absl::StrCat("guards.reference_kernels[", i, "]");
    if (!kernels[i].IsScalar() || !kKernels.count(kernels[i].Scalar())) {
      r.Error(kernels[i], path, absl::StrCat("must be one of: ", absl::StrJoin(kKernels, ", ")));
    } else {
      g->reference_kernels.push_back(kernels[i].Scalar());
    }
  }
}

// grpc: the connection limits of every gRPC listener (GrpcConfig).
void ReadGrpc(Reader& r, const YAML::Node& node, GrpcConfig* g) {
  if (!r.Map(node, "grpc",
             {"handshake_timeout_ms", "max_connection_idle_ms", "max_connection_age_ms",
              "max_connection_age_grace_ms"})) {
    return;
  }
  r.Int(node, "grpc", "handshake_timeout_ms", false, kMinGrpcLimitMs, kMaxGrpcHandshakeMs,
        &g->handshake_timeout_ms);
  r.LimitMs(node, "grpc", "max_connection_idle_ms", kMinGrpcLimitMs, kMaxGrpcLimitMs,
            &g->max_connection_idle_ms);
  r.LimitMs(node, "grpc", "max_connection_age_ms", kMinGrpcLimitMs, kMaxGrpcLimitMs,
            &g->max_connection_age_ms);
  r.LimitMs(node, "grpc", "max_connection_age_grace_ms", kMinGrpcLimitMs, kMaxGrpcLimitMs,
            &g->max_connection_age_grace_ms);
  if (g->max_connection_age_grace_ms != 0 && g->max_connection_age_ms == 0) {
    r.Error(node["max_connection_age_grace_ms"], "grpc.max_connection_age_grace_ms",
            "needs grpc.max_connection_age_ms (the grace follows a connection's maximum age)");
  }
}

// security: {api_keys_file, tls: {cert_file, key_file}, cluster_tls: {ca_file, cert_file,
// key_file}}. Each block is all-or-nothing: a certificate without its key is an error here, not
// a process that starts without TLS. Whether the files exist and parse is checked when a
// process starts (common/tls_credentials.h), where they are read.
void ReadSecurity(Reader& r, const YAML::Node& node, SecurityConfig* s) {
  if (!r.Map(node, "security", {"api_keys_file", "tls", "cluster_tls"})) return;
  r.String(node, "security", "api_keys_file", false, &s->api_keys_file);
  const YAML::Node tls = r.Field(node, "security", "tls", false);
  if (!tls.IsNull() && r.Map(tls, "security.tls", {"cert_file", "key_file"})) {
    r.String(tls, "security.tls", "cert_file", true, &s->tls_cert_file);
    r.String(tls, "security.tls", "key_file", true, &s->tls_key_file);
  }
  const YAML::Node cluster = r.Field(node, "security", "cluster_tls", false);
  if (!cluster.IsNull() &&
      r.Map(cluster, "security.cluster_tls", {"ca_file", "cert_file", "key_file"})) {
    r.String(cluster, "security.cluster_tls", "ca_file", true, &s->cluster_ca_file);
    r.String(cluster, "security.cluster_tls", "cert_file", true, &s->cluster_cert_file);
    r.String(cluster, "security.cluster_tls", "key_file", true, &s->cluster_key_file);
  }
}

// Ports unique per host, GPUs given once per host, worker names unique.
// What the config alone can tell about where a host string points (no name lookups: validation
// stays offline and deterministic). Loopback names and the wildcard address all mean the machine
// that runs the process; any other name stands for itself.
bool IsWildcardHost(absl::string_view host) {
  return host == "0.0.0.0" || host == "::" || host == "[::]";
}
bool IsLocalHost(absl::string_view host) {
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "::1" ||
         host == "[::1]" || IsWildcardHost(host);
}
// The machine of `host`: one key for every local alias.
std::string MachineOf(const std::string& host) {
  return IsLocalHost(host) ? std::string("this machine") : host;
}
// The address a listener on `host` binds ("localhost" is 127.0.0.1).
std::string AddressOf(const std::string& host) {
  return host == "localhost" ? std::string("127.0.0.1") : host;
}
// Two listeners on one port clash when they bind the same address, or one binds the wildcard
// address of the machine the other is on.
bool PortsClash(const std::string& a, const std::string& b) {
  return AddressOf(a) == AddressOf(b) ||
         ((IsWildcardHost(a) || IsWildcardHost(b)) && MachineOf(a) == MachineOf(b));
}

void CheckCrossFields(Reader& r, const DeployConfig& c, const YAML::Node& root,
                      const std::vector<YAML::Node>& worker_nodes) {
  struct Claim {
    std::string host;
    int port;
    std::string owner;
  };
  std::vector<Claim> ports;
  auto claim_port = [&](const std::string& host, int port, const std::string& owner,
                        const YAML::Node& at, const std::string& key) {
    if (port == 0) return;
    for (const Claim& other : ports) {
      if (other.port == port && PortsClash(host, other.host)) {
        r.Error(at, key,
                absl::StrCat("port ", port, " on ", host, " is already used by ", other.owner,
                             other.host == host ? "" : absl::StrCat(" (on ", other.host, ")")));
        return;
      }
    }
    ports.push_back({host, port, owner});
  };
  // yaml-cpp throws on type queries of a missing key's node: check IsDefined() first.
  const YAML::Node router = root["router"];
  if (router.IsDefined() && router.IsMap()) {
    auto at = [&router](const char* key) {
      const YAML::Node node = router[key];
      return node.IsDefined() ? node : router;
    };
    claim_port(c.router.host, c.router.http_port, "router.http_port", at("http_port"),
               "router.http_port");
    claim_port(c.router.host, c.router.grpc_port, "router.grpc_port", at("grpc_port"),
               "router.grpc_port");
  }
  std::set<std::string> names;
  std::map<std::pair<std::string, int>, std::string> gpus;
  size_t n = 0;
  for (const auto* list : {&c.prefill, &c.decode}) {
    const std::string role = list == &c.prefill ? "prefill" : "decode";
    for (size_t i = 0; i < list->size(); ++i, ++n) {
      const WorkerConfig& w = (*list)[i];
      const YAML::Node& node = worker_nodes[n];
      if (!node.IsMap()) continue;
      const std::string path = absl::StrCat(role, "[", i, "]");
      if (!w.name.empty() && !names.insert(w.name).second) {
        r.Error(node["name"], Join(path, "name"), absl::StrCat("duplicate worker name ", w.name));
      }
      claim_port(w.host, w.port, Join(path, "port"), node["port"], Join(path, "port"));
      claim_port(w.host, w.metrics_port, Join(path, "metrics_port"), node["metrics_port"],
                 Join(path, "metrics_port"));
      if (w.gpus.empty() || c.share_gpus) continue;
      for (absl::string_view id : absl::StrSplit(w.gpus, ',')) {
        int gpu = 0;
        if (!absl::SimpleAtoi(id, &gpu)) continue;
        // GPUs belong to machines: 127.0.0.1, localhost and 0.0.0.0 share this one's.
        auto [it, fresh] = gpus.emplace(std::make_pair(MachineOf(w.host), gpu), path);
        if (!fresh) {
          r.Error(node["gpus"], Join(path, "gpus"),
                  absl::StrCat("GPU ", gpu, " on ", w.host, " is already given to ", it->second));
        }
      }
    }
  }
}

// transfer.cuda_ipc: on asks for a device-to-device path that needs a backend cuda worker on
// both sides; a config with none on either side could never use it (a typo, or a CPU config
// copied from a GPU one).
void CheckCudaIpc(Reader& r, const DeployConfig& c, const YAML::Node& transfer) {
  if (c.transfer_cuda_ipc != "on") return;
  auto any_cuda = [](const std::vector<WorkerConfig>& workers) {
    return std::any_of(workers.begin(), workers.end(),
                       [](const WorkerConfig& w) { return w.backend == "cuda"; });
  };
  if (!any_cuda(c.prefill) || !any_cuda(c.decode)) {
    r.Error(transfer["cuda_ipc"], "transfer.cuda_ipc",
            "on needs a backend cuda prefill worker and a backend cuda decode worker (auto uses "
            "the path where they exist; off never does)");
    return;
  }
  // The decode worker's device page pool only feeds the early import: without it every request
  // goes by host pages while the prefill worker's arena still takes its HBM.
  if (!c.transfer_early_import) {
    r.Error(transfer["cuda_ipc"], "transfer.cuda_ipc",
            "on needs transfer.early_import: true (the decode worker lands GPU pages only for "
            "the early import; without it every request goes by host pages)");
  }
}

// The error of a config file that cannot be read: `cause`, and for a relative path the absolute
// one and the working directory it was resolved against (`pdserve up`, a unit or a script may
// run from another directory than the one the path is relative to).
ParsedDeployConfig FileError(const std::string& path, absl::string_view cause) {
  ParsedDeployConfig out;
  std::string message(cause);
  if (std::filesystem::path(path).is_relative()) {
    std::error_code ec;
    const std::filesystem::path cwd = std::filesystem::current_path(ec);
    absl::StrAppend(&message, " (",
                    ec ? "the working directory is unknown"
                       : absl::StrCat((cwd / path).lexically_normal().string(),
                                      ": a relative path is resolved against the working "
                                      "directory ",
                                      cwd.string()),
                    ")");
  }
  out.errors.push_back({path, 0, 0, "(file)", std::move(message)});
  return out;
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseGpuList(absl::string_view gpus, bool allow_repeats) {
  std::vector<int> ids;
  for (absl::string_view id : absl::StrSplit(gpus, ',')) {
    // Digits only (no spaces, signs or leading zeros): the list goes on to CUDA_VISIBLE_DEVICES,
    // which must read it as this parse does.
    int gpu = 0;
    const bool digits =
        !id.empty() && id.size() <= 4 &&
        std::all_of(id.begin(), id.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
        (id.size() == 1 || id[0] != '0');
    if (!digits || !absl::SimpleAtoi(id, &gpu) || gpu > kMaxGpuIndex) {
      return absl::InvalidArgumentError(
          absl::StrCat("must be comma-separated GPU indices 0..", kMaxGpuIndex, ", e.g. \"0,1\""));
    }
    if (!allow_repeats && std::find(ids.begin(), ids.end(), gpu) != ids.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("names GPU ", gpu, " twice (a worker runs one rank per GPU)"));
    }
    ids.push_back(gpu);
  }
  return ids;
}

std::string ConfigError::ToString() const {
  return absl::StrCat(file, ":", line, ":", column, ": ", key, ": ", message);
}

ParsedDeployConfig ParseDeployConfig(absl::string_view yaml, const std::string& file) {
  ParsedDeployConfig out;
  Reader r(file, &out.errors);
  YAML::Node root;
  try {
    // Every document is read, so a second one (after a `---`) is an error, not silently dropped.
    // Empty documents (a trailing `---`) do not count.
    std::vector<YAML::Node> documents;
    for (const YAML::Node& d : YAML::LoadAll(std::string(yaml))) {
      if (!d.IsNull()) documents.push_back(d);
    }
    if (documents.size() > 1) {
      r.Error(documents[1].Mark(), "(document)",
              absl::StrCat("a deploy config is one YAML document; this file has ", documents.size(),
                           " (the second starts here)"));
      return out;
    }
    if (!documents.empty()) root = documents[0];
  } catch (const YAML::Exception& e) {
    r.Error(e.mark, "(syntax)", e.msg);
    return out;
  }
  DeployConfig& c = out.config;
  if (!r.Map(root, "",
             {"name", "model", "router", "prefill", "decode", "transfer", "guards", "security",
              "grpc", "share_gpus"})) {
    return out;
  }
  r.String(root, "", "name", true, &c.name);
  const YAML::Node model = r.Field(root, "", "model", true);
  if (!model.IsNull() && r.Map(model, "model", {"path", "served_name"})) {
    r.String(model, "model", "path", true, &c.model_path);
    r.String(model, "model", "served_name", false, &c.served_name);
  }
  const YAML::Node router = r.Field(root, "", "router", true);
  if (!router.IsNull()) ReadRouter(r, router, &c.router);
  std::vector<YAML::Node> worker_nodes;
  c.prefill = ReadWorkers(r, root, "prefill", &worker_nodes);
  c.decode = ReadWorkers(r, root, "decode", &worker_nodes);
  const YAML::Node transfer = r.Field(root, "", "transfer", false);
  if (!transfer.IsNull() &&
      r.Map(transfer, "transfer",
            {"transport", "lease_ms", "lanes", "early_import", "ucx_protocols", "register_pages",
             "shm_pull", "cuda_ipc", "cuda_ipc_arena_tokens"})) {
    r.Enum(transfer, "transfer", "transport", false, kTransports, &c.transport);
    r.Int(transfer, "transfer", "lease_ms", false, kMinLeaseMs, 3600000, &c.lease_ms);
    r.Int(transfer, "transfer", "lanes", false, 0, kMaxConfigTransferLanes, &c.transfer_lanes);
    r.Bool(transfer, "transfer", "early_import", &c.transfer_early_import);
    r.Enum(transfer, "transfer", "ucx_protocols", false, {"v1", "v2"}, &c.transfer_ucx_protocols);
    r.Bool(transfer, "transfer", "register_pages", &c.transfer_register_pages);
    r.Bool(transfer, "transfer", "shm_pull", &c.transfer_shm_pull);
    r.Enum(transfer, "transfer", "cuda_ipc", false, {"auto", "on", "off"}, &c.transfer_cuda_ipc);
    r.Int(transfer, "transfer", "cuda_ipc_arena_tokens", false, 0, kMaxCudaIpcArenaTokens,
          &c.transfer_cuda_ipc_arena_tokens);
  }
  const YAML::Node guards = r.Field(root, "", "guards", false);
  if (!guards.IsNull()) ReadGuards(r, guards, &c.guards);
  const YAML::Node security = r.Field(root, "", "security", false);
  if (!security.IsNull()) ReadSecurity(r, security, &c.security);
  const YAML::Node grpc = r.Field(root, "", "grpc", false);
  if (!grpc.IsNull()) ReadGrpc(r, grpc, &c.grpc);
  r.Bool(root, "", "share_gpus", &c.share_gpus);
  CheckCrossFields(r, c, root, worker_nodes);
  CheckCudaIpc(r, c, transfer);
  return out;
}

ParsedDeployConfig LoadDeployConfigFile(const std::string& path) {
  if (path.empty()) {  // `--config ''`: not "the working directory does not exist"
    ParsedDeployConfig out;
    out.errors.push_back({"(no file)", 0, 0, "(file)",
                          "the config path is empty: give the path of a YAML deploy config (e.g. "
                          "deploy/local.yaml)"});
    return out;
  }
  if (const absl::Status file = common::CheckRegularFile(path); !file.ok()) {
    // The error line names the file already: the message is the cause alone.
    absl::string_view cause = absl::StripPrefix(file.message(), path);
    cause = absl::StripPrefix(absl::StripLeadingAsciiWhitespace(cause), ": ");
    return FileError(path, cause);
  }
  std::ifstream in(path);
  if (!in) return FileError(path, "cannot read the file");
  std::stringstream text;
  text << in.rdbuf();
  return ParseDeployConfig(text.str(), path);
}

absl::StatusOr<DeployConfig> LoadDeployConfig(const std::string& path) {
  ParsedDeployConfig parsed = LoadDeployConfigFile(path);
  if (parsed.errors.empty()) return std::move(parsed.config);
  std::vector<std::string> lines;
  for (const ConfigError& e : parsed.errors) lines.push_back(e.ToString());
  return absl::InvalidArgumentError(absl::StrJoin(lines, "\n"));
}

absl::Status CheckModelPath(const DeployConfig& config) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::path(config.model_path) / "config.json", ec)) {
    return absl::OkStatus();
  }
  const std::string cwd = std::filesystem::current_path(ec).string();
  return absl::FailedPreconditionError(absl::StrCat(
      "model path '", config.model_path, "' has no config.json as seen from the working directory ",
      cwd.empty() ? "(unknown)" : cwd,
      std::filesystem::path(config.model_path).is_relative()
          ? " (a relative model.path is resolved against it: run from the directory it is relative "
            "to, e.g. the repository root, or make it absolute)"
          : ""));
}

std::string IdleChannelWarning(const DeployConfig& config) {
  const int idle_ms = config.grpc.max_connection_idle_ms;
  if (idle_ms == 0 || config.router.health_interval_ms < idle_ms) return "";
  return absl::StrCat("router.health_interval_ms ", config.router.health_interval_ms,
                      " is not below grpc.max_connection_idle_ms ", idle_ms,
                      ": the workers close the router's idle connections between two health "
                      "checks, and the next call to each worker connects again first");
}

std::string EffectiveCudaIpc(const DeployConfig& config) {
  if (config.transfer_cuda_ipc != "auto") return config.transfer_cuda_ipc;
  auto one_gpu_cuda = [](const std::vector<WorkerConfig>& workers) {
    return std::any_of(workers.begin(), workers.end(), [](const WorkerConfig& w) {
      const absl::StatusOr<std::vector<int>> gpus = ParseGpuList(w.gpus);
      return w.backend == "cuda" && gpus.ok() && gpus->size() == 1;
    });
  };
  const bool usable =
      config.transfer_early_import && one_gpu_cuda(config.prefill) && one_gpu_cuda(config.decode);
  return usable ? "auto" : "off";
}

}  // namespace pdserve::config
