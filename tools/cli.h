// The `v4attn` command line: shared pieces of the subcommands.
//
// Adding a subcommand: write tools/cmd_<name>.cpp with
//   void register_<name>_command(CLI::App& app, CommandResult& result);
// which adds the subcommand, its options and --help text, and (in the subcommand's callback)
// stores what to run in result.action; declare it below and add one line to main.cpp's
// kCommands table. main parses, then runs the action inside its single error handler, so a
// subcommand just throws: ConfigError or UsageError -> exit 2 with one line on stderr, any
// other exception -> exit 1. The action returns the exit code (0 on success).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <iosfwd>
#include <stdexcept>
#include <string>

#include "v4attn/plan.h"

namespace v4attn::cli {

// The action of the subcommand the command line selected (empty until one is parsed).
struct CommandResult {
  std::function<int()> action;
};

// A bad command-line value found after parsing (exit code 2, like a parse error).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// --config FILE and --tp N, as every config-driven subcommand spells them.
struct ConfigOptions {
  std::string config_path;  // empty: the embedded V4.1-Flash default
  int tp = 1;
};
void add_config_options(CLI::App& sub, ConfigOptions& options);
// load_config + build_plan for the options (throws ConfigError).
ModelPlan plan_from_options(const ConfigOptions& options);

// The plan's per-mode counts and weight totals, a few lines (used by `plan` and `main`).
void print_plan_summary(const ModelPlan& plan, std::ostream& out);

// Subcommands (one file each).
void register_plan_command(CLI::App& app, CommandResult& result);  // tools/cmd_plan.cpp
void register_main_command(CLI::App& app, CommandResult& result);  // tools/cmd_main.cpp
void register_bench_command(CLI::App& app, CommandResult& result);  // tools/cmd_bench.cpp

}  // namespace v4attn::cli
