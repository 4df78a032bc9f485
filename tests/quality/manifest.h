// The text manifest of the quality harness: Debian-shipped English files, each with its sha256
// and a role (eval texts are scored; calib texts calibrate VECTOR and must stay disjoint).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::quality {

struct ManifestEntry {
  std::string sha256;  // lower-case hex
  std::string role;    // "eval" or "calib"
  std::string path;
};

struct ManifestText {
  ManifestEntry entry;
  std::string text;  // verified contents
};

// Parses "sha256 role path" lines ('#' comments, blank lines ignored).
// INVALID_ARGUMENT naming the line for a malformed line or an unknown role.
StatusOr<std::vector<ManifestEntry>> ParseManifest(const std::string& contents);
StatusOr<std::vector<ManifestEntry>> LoadManifest(const std::string& path);

// Reads and verifies the entries of `role`. A missing file or a digest mismatch is skipped with a
// line in `*warnings` (Debian versions may differ); NOT_FOUND when no entry of the role survives.
StatusOr<std::vector<ManifestText>> ReadVerified(const std::vector<ManifestEntry>& entries,
                                                 const std::string& role,
                                                 std::vector<std::string>* warnings);

// Reads files given by path (kvd-quality --text-file) as eval texts, recording each file's sha256
// (role "eval"). NOT_FOUND naming an unreadable file; INVALID_ARGUMENT naming a file that is empty
// or not valid UTF-8.
StatusOr<std::vector<ManifestText>> ReadTextFiles(const std::vector<std::string>& paths);

// Whether `s` is well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool IsValidUtf8(std::string_view s);

}  // namespace kvd::quality
