#include "kvd/common/cli.h"

#include <iostream>

namespace kvd::cli {

namespace {

void LastValueWins(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    if (o->get_expected_max() == 1 && o->get_type_size_max() == 1) {
      o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) LastValueWins(*sub);
}

}  // namespace

int Parse(CLI::App& app, int argc, char** argv) {
  LastValueWins(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help (or --version)
    return UsageError(app, e.what());
  }
  return -1;
}

int UsageError(const CLI::App& app, const std::string& why) {
  std::cerr << app.get_name() << ": " << why << "\nRun " << app.get_name()
            << " --help for the options.\n";
  return kExitUsage;
}

}  // namespace kvd::cli
