#include "manifest.h"

#include <fstream>
#include <sstream>

#include "sha256.h"

namespace kvd::quality {

StatusOr<std::vector<ManifestEntry>> ParseManifest(const std::string& contents) {
  std::vector<ManifestEntry> out;
  std::istringstream in(contents);
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    std::istringstream ls(line);
    ManifestEntry e;
    std::string extra;
    if (!(ls >> e.sha256 >> e.role >> e.path) || (ls >> extra)) {
      return Status::InvalidArgument("manifest line " + std::to_string(no) +
                                     ": expected 'sha256 role path'");
    }
    if (e.sha256.size() != 64 ||
        e.sha256.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return Status::InvalidArgument("manifest line " + std::to_string(no) +
                                     ": sha256 must be 64 lower-case hex digits");
    }
    if (e.role != "eval" && e.role != "calib") {
      return Status::InvalidArgument("manifest line " + std::to_string(no) + ": role '" + e.role +
                                     "' is neither eval nor calib");
    }
    out.push_back(std::move(e));
  }
  return out;
}

StatusOr<std::vector<ManifestEntry>> LoadManifest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot read manifest " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto r = ParseManifest(ss.str());
  if (!r.ok()) return r.status().WithContext(path);
  return r;
}

StatusOr<std::vector<ManifestText>> ReadVerified(const std::vector<ManifestEntry>& entries,
                                                 const std::string& role,
                                                 std::vector<std::string>* warnings) {
  std::vector<ManifestText> out;
  for (const ManifestEntry& e : entries) {
    if (e.role != role) continue;
    std::ifstream in(e.path, std::ios::binary);
    if (!in) {
      warnings->push_back("skipped " + e.path + ": cannot read it");
      continue;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    const std::string got = Sha256Hex(text);
    if (got != e.sha256) {
      warnings->push_back("skipped " + e.path + ": sha256 " + got + " != manifest " + e.sha256);
      continue;
    }
    out.push_back({e, std::move(text)});
  }
  if (out.empty())
    return Status::NotFound("no readable, verified '" + role + "' text in the manifest");
  return out;
}

}  // namespace kvd::quality
