// Subcommand registry of the `pdserve` binary.
//
// Each subcommand lives in its own cli/<name>_command.cc and registers itself with a file-scope
// CommandRegistrar, so adding a command never edits main.cc. Registration happens during static
// initialization of the executable (single-threaded); Installers() is not used after main starts
// parsing.
#pragma once

#include <functional>
#include <vector>

#include "CLI/CLI.hpp"

namespace pdserve::cli {

// Adds one subcommand to `app`. The subcommand's callback stores its process exit status in
// `*exit_code` (0 on success); errors are printed to stderr by the callback itself.
using CommandInstaller = std::function<void(CLI::App& app, int* exit_code)>;

std::vector<CommandInstaller>& Installers();

// Option checks with plain messages ("--max-tokens: must be > 0, got 0"); CLI11's own
// PositiveNumber / NonNegativeNumber print the range as doubles ("0.000000 to 1797...").
// A value that is not a finite number is refused too (NaN passes every comparison check).
CLI::Validator Positive();
CLI::Validator NonNegative();

struct CommandRegistrar {
  explicit CommandRegistrar(CommandInstaller installer) {
    Installers().push_back(std::move(installer));
  }
};

}  // namespace pdserve::cli
