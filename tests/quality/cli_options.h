// The command-line options kvd-quality and kvd-quality-diag share (CLI11; the conventions of
// kvd/common/cli.h: generated --help, usage errors exit 2 naming the option). Each tool binds
// them to its own options struct, whose current values are the defaults --help shows.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace kvd::quality {

// Where the shared options store their values (all required).
struct EvalOptionTargets {
  std::string* model_path;               // --model PATH
  std::string* manifest_path;            // --manifest FILE
  std::string* out_dir;                  // --out DIR
  std::vector<std::string>* text_files;  // --text-file PATH (repeatable)
  int* segments;                         // --segments N
  int* prefix_tokens;                    // --prefix N
  int* continuation_tokens;              // --continuation N
  int* window;                           // --window W
  int* threads;                          // --threads N
};

// Declares --model, --manifest, --out, --text-file, --segments, --prefix, --continuation,
// --window and --threads on `app`. Returns the --model option (required or not is the tool's
// choice).
CLI::Option* AddEvalOptions(CLI::App& app, const EvalOptionTargets& t);

// The command line as typed, "<program> arg1 arg2 ..." (the reports' provenance line).
std::string CommandLine(const std::string& program, int argc, char** argv);

}  // namespace kvd::quality
