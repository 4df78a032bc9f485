// The command-line conventions every kvd program shares (kvd, kvdctl, kvd-bench, kvd-roundtrip,
// kvd-llama, kvd-demo, kvd-quality, kvd-quality-diag), on CLI11:
//   - `-h` / `--help` prints the generated help (every option with its description) and exits 0;
//   - a usage error (unknown option, missing or bad value, missing required option) prints
//     "<program>: <what, naming the option>" and "Run <program> --help for the options." to
//     stderr and exits 2 (kExitUsage);
//   - an option that takes one value may be given again: the last value wins (as the programs'
//     former hand-written parsers did; scripts append overrides to a common argument list);
//     options that collect values (repeatable, comma lists) keep every value.
// Not part of libkvd_client's API (the library kvd_cli links CLI11; it is not installed).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace kvd::cli {

inline constexpr int kExitUsage = 2;

// Parses `app` (after making every single-value option of it and its subcommands take the last
// value given). Returns -1 when the program goes on, else its exit code: 0 after --help (the
// help is printed to stdout), kExitUsage after a usage error (printed to stderr as above; the
// program's name is app.get_name()).
int Parse(CLI::App& app, int argc, char** argv);

// Prints "<program>: <why>" and the pointer to --help to stderr; returns kExitUsage. For usage
// errors found after Parse (e.g. two options that exclude each other).
int UsageError(const CLI::App& app, const std::string& why);

}  // namespace kvd::cli
