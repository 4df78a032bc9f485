#include "kvd/common/cli.h"

#include <iostream>

namespace kvd::cli {

int Parse(CLI::App& app, int argc, char** argv) {
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
