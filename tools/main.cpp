// `v4attn`: the engine's command line. Subcommands live in tools/cmd_<name>.cpp and register
// themselves through kCommands below (see tools/cli.h for how to add one).
//
// Exit codes: 0 success; 2 usage or config error (one line on stderr); 1 any other failure.
#include <algorithm>
#include <exception>
#include <iostream>
#include <string>

#include "cli.h"
#include "v4attn/build_info.h"
#include "v4attn/config.h"

namespace {

using v4attn::cli::CommandResult;
using Registrar = void (*)(CLI::App&, CommandResult&);

// One line per subcommand.
constexpr Registrar kCommands[] = {
    v4attn::cli::register_plan_command,
    v4attn::cli::register_main_command,
    v4attn::cli::register_bench_command,
};

// The promise is one line on stderr per error; some library messages carry newlines.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

int fail(int code, const std::string& message) {
  std::cout.flush();  // keep whatever was printed before the error in order
  std::cerr << "v4attn: " << one_line(message) << std::endl;
  return code;
}

int run(int argc, char** argv) {
  CLI::App app{"DeepSeek-V4.1-Flash attention engine: decode and target-verify prepare and "
               "attention on Hopper, with a bit-exact CPU reference.",
               "v4attn"};
  app.set_version_flag("--version", "v4attn " + v4attn::build_string());
  app.require_subcommand(1);
  CommandResult result;
  for (Registrar add : kCommands) add(app, result);

  // CLI11 reports a missing subcommand before unexpected arguments, so `v4attn foo` would say
  // "A subcommand is required"; name the unknown one instead.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string name = argv[1];
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      found = found || sub->check_name(name);
      known += (known.empty() ? "" : ", ") + sub->get_name();
    }
    if (!found) return fail(2, "unknown subcommand \"" + name + "\" (subcommands: " + known + ")");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help / --version: printed to stdout
    return fail(2, std::string(e.what()) + " (run v4attn --help for usage)");
  }
  if (!result.action) return fail(1, "internal error: the subcommand registered no action");
  const int code = result.action();
  std::cout.flush();
  if (!std::cout) return fail(1, "error: could not write to stdout");
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const v4attn::ConfigError& e) {
    return fail(2, e.what());
  } catch (const v4attn::cli::UsageError& e) {
    return fail(2, e.what());
  } catch (const std::exception& e) {
    return fail(1, std::string("error: ") + e.what());
  } catch (...) {
    return fail(1, "error: unknown exception");
  }
}
