// `v4attn main`: the main job of scripts/main.sh. Placeholder until the GPU stack and the CPU
// reference step exist: it shows the V4.1-Flash layer plan those will run.
#include <iostream>
#include <memory>

#include "cli.h"
#include "v4attn/config.h"

namespace v4attn::cli {

void register_main_command(CLI::App& app, CommandResult& result) {
  CLI::App* sub = app.add_subcommand(
      "main", "The main job: a target-verify cycle of the V4.1-Flash prepare stack on a GPU, or "
              "the CPU reference on a reduced config without one (placeholder: prints the plan "
              "summary).");
  sub->callback([&result] {
    result.action = [] {
      const ModelPlan plan = build_plan(load_config(""), 1);
      print_plan_summary(plan, std::cout);
      std::cout << "v4attn main: the GPU prepare stack and the CPU reference run come in later "
                   "work; nothing was run.\n";
      return 0;
    };
  });
}

}  // namespace v4attn::cli
