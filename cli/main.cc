// The `pdserve` binary: one executable, one subcommand per job (score, generate, serve, prefill,
// decode, router, up, ...). Subcommands register themselves (command_registry.h).
#include <cstdio>

#include "cli/command_registry.h"

namespace pdserve::cli {
std::vector<CommandInstaller>& Installers() {
  static std::vector<CommandInstaller> installers;
  return installers;
}
}  // namespace pdserve::cli

int main(int argc, char** argv) {
  CLI::App app{
      "pdserve: disaggregated prefill/decode serving for DeepSeek sparse-attention models"};
  app.require_subcommand(1);
  int exit_code = 0;
  for (const auto& install : pdserve::cli::Installers()) install(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
