// `pdserve validate-config FILE...`: checks deployment files (common/deploy_config.h).
//
// Prints "FILE: ok (...)" per valid file on stdout, and every error of an invalid one on stderr
// as "file:line:column: key: message", and a warning on stderr when a valid file's model path has
// no config.json from the current directory, its transfer.lease_ms is below
// config::kLeaseWarnBelowMs, or config::IdleChannelWarning has one. Exit status 0 when all files
// are valid, 1 otherwise.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli/command_registry.h"
#include "common/deploy_config.h"

namespace pdserve::cli {
namespace {

int RunValidate(const std::vector<std::string>& files) {
  int status = 0;
  for (const std::string& file : files) {
    const config::ParsedDeployConfig parsed = config::LoadDeployConfigFile(file);
    for (const config::ConfigError& e : parsed.errors) {
      std::fprintf(stderr, "%s\n", e.ToString().c_str());
    }
    if (!parsed.errors.empty()) {
      status = 1;
      continue;
    }
    const config::DeployConfig& c = parsed.config;
    if (const absl::Status model = config::CheckModelPath(c); !model.ok()) {
      // Not an error: the file may be checked where the model is not installed.
      std::fprintf(stderr, "%s: warning: %s; processes started here would fail\n", file.c_str(),
                   std::string(model.message()).c_str());
    }
    if (c.lease_ms < config::kLeaseWarnBelowMs) {
      std::fprintf(stderr,
                   "%s: warning: transfer.lease_ms %d is below %d: a prefill worker gives up a "
                   "queued request after half the lease (429 prefill_busy), so one prefill that "
                   "takes longer than %d ms refuses the request behind it\n",
                   file.c_str(), c.lease_ms, config::kLeaseWarnBelowMs, c.lease_ms / 2);
    }
    if (const std::string idle = config::IdleChannelWarning(c); !idle.empty()) {
      std::fprintf(stderr, "%s: warning: %s\n", file.c_str(), idle.c_str());
    }
    std::printf("%s: ok (%s: %zu prefill, %zu decode workers, model %s)\n", file.c_str(),
                c.name.c_str(), c.prefill.size(), c.decode.size(), c.model_path.c_str());
  }
  return status;
}

const CommandRegistrar kValidateConfig([](CLI::App& app, int* exit_code) {
  auto files = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand("validate-config", "Check deployment YAML files");
  cmd->add_option("files", *files, "Deployment files (deploy/config/*.yaml)")->required();
  cmd->callback([files, exit_code] { *exit_code = RunValidate(*files); });
});

}  // namespace
}  // namespace pdserve::cli
