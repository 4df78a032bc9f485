// The text manifest of the quality harness: Debian-shipped English files, each with its sha256
// and a role (eval texts are scored; calib texts calibrate VECTOR and must stay disjoint).
#pragma once

#include <string>
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

}  // namespace kvd::quality
