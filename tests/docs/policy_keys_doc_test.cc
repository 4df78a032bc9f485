// docs/configuration.md's compression-policy table against the stage registry
// (kernels/stages.h): a row per policy key of every built-in stage, its default as the registry
// declares it, its range ("in [min, max]", "in [min, max)" or ">= min") and every choice of a
// choice key. The registry of this process holds the built-in stages only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "kvd/kernels/stages.h"

namespace kvd::kernels {
namespace {

std::string ConfigurationDoc() {
  std::ifstream in(std::string(KVD_SOURCE_DIR) + "/docs/configuration.md");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The table row of `key`: "| `key` | default | effect |" ("" when there is none).
std::string RowOf(const std::string& doc, const std::string& key) {
  const std::string head = "\n| `" + key + "` | ";
  const size_t at = doc.find(head);
  if (at == std::string::npos) return "";
  return doc.substr(at + 1, doc.find('\n', at + 1) - at - 1);
}

// A range end as the doc writes it: 2^k for powers of two from 2^20, else %g.
std::string End(double v) {
  const double k = std::log2(v);
  if (v >= (1 << 20) && k == std::trunc(k)) return "2^" + std::to_string(static_cast<int>(k));
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

// The default cell: the choice's name, true / false, the followed key or the number.
std::string DefaultCell(const StagePolicyKey& k) {
  if (!k.default_key.empty()) return "`" + k.default_key + "`";
  if (k.type == PolicyKeyType::kBool) return k.default_value != 0 ? "`true`" : "`false`";
  if (k.type == PolicyKeyType::kChoice) return "`" + StageKeyText(k, k.default_value) + "`";
  return "`" + End(k.default_value) + "`";
}

std::string RangeText(const StagePolicyKey& k) {
  if (std::isinf(k.max)) return ">= " + End(k.min);
  return "in [" + End(k.min) + ", " + End(k.max) + (k.max_open ? ")" : "]");
}

TEST(PolicyKeysDocTest, ConfigurationListsEveryRegisteredKeyWithItsDefaultRangeAndChoices) {
  const std::string doc = ConfigurationDoc();
  ASSERT_FALSE(doc.empty());
  const StageRegistry& registry = StageRegistry::Global();
  ASSERT_FALSE(registry.PolicyKeyNames().empty());
  for (const std::string& name : registry.PolicyKeyNames()) {
    SCOPED_TRACE(name);
    const StagePolicyKey* key = nullptr;
    const StageRegistration* owner = registry.FindPolicyKey(name, &key);
    const std::string row = RowOf(doc, name);
    ASSERT_FALSE(row.empty()) << "docs/configuration.md has no row | `" << name << "` | ...";
    EXPECT_EQ(row.find("| `" + name + "` | " + DefaultCell(*key) + " | "), 0u) << row;
    EXPECT_NE(row.find("nly with the `" + owner->name + "` stage"), std::string::npos) << row;
    if (key->type == PolicyKeyType::kInt || key->type == PolicyKeyType::kDouble) {
      EXPECT_NE(row.find(RangeText(*key)), std::string::npos) << RangeText(*key) << ": " << row;
    }
    for (const std::string& choice : key->choices) {
      EXPECT_NE(row.find("`" + choice + "`"), std::string::npos) << choice << ": " << row;
    }
  }
}

}  // namespace
}  // namespace kvd::kernels
