#include "manifest.h"

#include <cstdint>
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

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (int k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

StatusOr<std::vector<ManifestText>> ReadTextFiles(const std::vector<std::string>& paths) {
  std::vector<ManifestText> out;
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status::NotFound("cannot read text file " + path);
    std::stringstream ss;
    ss << in.rdbuf();
    ManifestText t;
    t.text = ss.str();
    if (t.text.empty()) return Status::InvalidArgument("text file " + path + " is empty");
    if (!IsValidUtf8(t.text)) {
      return Status::InvalidArgument("text file " + path + " is not valid UTF-8");
    }
    t.entry = {Sha256Hex(t.text), "eval", path};
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace kvd::quality
