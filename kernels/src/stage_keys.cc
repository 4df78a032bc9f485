// The stage registry's policy keys (stages.h StagePolicyKey): their checks and texts, and the
// keys of the built-in quantize and expected_attention stages.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kvd/kernels/compact_chunk.h"
#include "plan_internal.h"

namespace kvd::kernels {
namespace {

std::string Num(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", v);
  return text;
}

std::string Int(double v) { return std::to_string(static_cast<int64_t>(v)); }

// The names of `codes` (compact_chunk.h QuantFormats, QuantRotations), in their order: a kChoice
// key's value indexes both.
template <typename Enum>
std::vector<std::string> NamesOf(const std::vector<Enum>& codes, std::string_view (*name)(Enum)) {
  std::vector<std::string> out;
  for (Enum code : codes) out.emplace_back(name(code));
  return out;
}

double IndexOf(const std::vector<std::string>& choices, std::string_view name) {
  return static_cast<double>(std::find(choices.begin(), choices.end(), name) - choices.begin());
}

// The index of a kChoice key's value in `keys` (set or default) into its choices.
size_t ChoiceIndex(const StageKeyValues& keys, std::string_view name) {
  return static_cast<size_t>(StageKeyValue(keys, name));
}

// The name of a kChoice key's value in `keys` (set or default).
std::string ChoiceText(const StageKeyValues& keys, std::string_view name) {
  const StagePolicyKey* key = nullptr;
  StageRegistry::Global().FindPolicyKey(name, &key);
  return StageKeyText(*key, StageKeyValue(keys, name));
}

constexpr char kQuantFormat[] = "quant_format";
constexpr char kQuantGroup[] = "quant_group";
constexpr char kQuantKeyGroup[] = "quant_key_group";
constexpr char kQuantRecent[] = "quant_recent";
constexpr char kQuantRotate[] = "quant_rotate";
constexpr char kQuantValueFormat[] = "quant_value_format";
constexpr char kSameFormat[] = "same";

constexpr char kEaFuturePositions[] = "ea_future_positions";
constexpr char kEaMinQueries[] = "ea_min_queries";
constexpr char kEaCovariance[] = "ea_covariance";
constexpr char kEaKeyDiffShare[] = "ea_keydiff_share";
constexpr char kEaRecentShare[] = "ea_recent_share";

}  // namespace

Status CheckStagePolicyKey(const StagePolicyKey& key, double value) {
  const std::string head = key.name + ": " + Num(value);
  if (!std::isfinite(value)) return Status::InvalidArgument(head + " is not a finite number");
  switch (key.type) {
    case PolicyKeyType::kBool:
      if (value != 0.0 && value != 1.0) {
        return Status::InvalidArgument(head + " is not a boolean (0 or 1)");
      }
      return Status::Ok();
    case PolicyKeyType::kChoice:
      if (value != std::trunc(value) || value < 0 ||
          value >= static_cast<double>(key.choices.size())) {
        return Status::InvalidArgument(head + " is not a choice index (0 to " +
                                       std::to_string(key.choices.size()) + ", excluded)");
      }
      return Status::Ok();
    case PolicyKeyType::kInt:
      if (value != std::trunc(value)) return Status::InvalidArgument(head + " is not an integer");
      break;
    case PolicyKeyType::kDouble:
      break;
  }
  if (!(value >= key.min && (key.max_open ? value < key.max : value <= key.max))) {
    return Status::InvalidArgument(head + " is outside [" + Num(key.min) + ", " + Num(key.max) +
                                   (key.max_open ? ")" : "]"));
  }
  return Status::Ok();
}

StatusOr<double> StageKeyChoice(const StagePolicyKey& key, std::string_view text) {
  const double index = IndexOf(key.choices, text);
  if (index < static_cast<double>(key.choices.size())) return index;
  std::string list;
  for (const std::string& c : key.choices) list += (list.empty() ? "" : ", ") + c;
  return Status::InvalidArgument(key.name + ": \"" + std::string(text) + "\" is not one of " +
                                 list + (key.choice_hint.empty() ? "" : " " + key.choice_hint));
}

std::string StageKeyText(const StagePolicyKey& key, double value) {
  if (key.type == PolicyKeyType::kChoice && value >= 0 &&
      value < static_cast<double>(key.choices.size())) {
    return key.choices[static_cast<size_t>(value)];
  }
  return Num(value);
}

double StageKeyValue(const StageKeyValues& keys, std::string_view key) {
  if (auto it = keys.find(key); it != keys.end()) return it->second;
  const StagePolicyKey* k = nullptr;
  if (StageRegistry::Global().FindPolicyKey(key, &k) == nullptr) return 0.0;
  return k->default_key.empty() ? k->default_value : StageKeyValue(keys, k->default_key);
}

double StageKeyValue(const CompressionPlanOptions& options, std::string_view key) {
  return StageKeyValue(options.stage_keys, key);
}

namespace internal {

std::vector<StagePolicyKey> QuantizeKeys() {
  const std::vector<std::string> formats = NamesOf(QuantFormats(), &QuantFormatName);
  std::vector<std::string> value_formats = {kSameFormat};
  value_formats.insert(value_formats.end(), formats.begin(), formats.end());
  const std::vector<std::string> rotations = NamesOf(QuantRotations(), &QuantRotationName);
  const StagePolicyKey group = {.name = kQuantGroup,
                                .type = PolicyKeyType::kInt,
                                .min = 1,
                                .max = 65536,
                                .default_value = 64,
                                .in_stage_canonical_form = true};
  StagePolicyKey key_group = group;
  key_group.name = kQuantKeyGroup;
  key_group.default_key = kQuantGroup;
  return {{.name = kQuantFormat,
           .type = PolicyKeyType::kChoice,
           .default_value = IndexOf(formats, "int8"),
           .choices = formats,
           .choice_hint = "(to store full precision, drop the quantize stage)",
           .in_stage_canonical_form = true},
          group,
          key_group,
          {.name = kQuantRecent,
           .type = PolicyKeyType::kInt,
           .min = 0,
           .max = 1 << 30,
           .default_value = 0,
           .in_stage_canonical_form = true},
          {.name = kQuantSinks,
           .type = PolicyKeyType::kInt,
           .min = 0,
           .max = 1 << 30,
           .default_value = 0,
           .in_stage_canonical_form = true},
          {.name = kQuantRotate,
           .type = PolicyKeyType::kChoice,
           .default_value = IndexOf(rotations, "none"),
           .choices = rotations,
           .in_stage_canonical_form = true},
          {.name = kQuantValueFormat,
           .type = PolicyKeyType::kChoice,
           .default_value = 0,
           .choices = value_formats,
           .in_stage_canonical_form = true}};
}

void ApplyQuantizeKeys(const StageKeyValues& keys, CompressionPlanOptions* o) {
  // quant_value_format's choices are "same", then quant_format's.
  const std::vector<QuantFormat> formats = QuantFormats();
  const QuantFormat format = formats[ChoiceIndex(keys, kQuantFormat)];
  const size_t values = ChoiceIndex(keys, kQuantValueFormat);
  const QuantFormat value_format = values == 0 ? format : formats[values - 1];
  o->quant = {.format = format,
              .key_group = static_cast<uint32_t>(StageKeyValue(keys, kQuantKeyGroup)),
              .value_group = static_cast<uint32_t>(StageKeyValue(keys, kQuantGroup)),
              .recent = static_cast<uint32_t>(StageKeyValue(keys, kQuantRecent)),
              .sinks = static_cast<uint32_t>(StageKeyValue(keys, kQuantSinks)),
              .rotation = QuantRotations()[ChoiceIndex(keys, kQuantRotate)],
              .value_format = value_format == format ? QuantFormat::kNone : value_format};
}

// " quant=<format>/<group>/<recent>", then the rotation, a key group, a value format of their
// own and the sinks only when they differ from the default.
std::string QuantizeCanonicalForm(const StageKeyValues& keys) {
  const std::string format = ChoiceText(keys, kQuantFormat);
  const std::string rotate = ChoiceText(keys, kQuantRotate);
  const std::string values = ChoiceText(keys, kQuantValueFormat);
  const double group = StageKeyValue(keys, kQuantGroup);
  const double key_group = StageKeyValue(keys, kQuantKeyGroup);
  const double sinks = StageKeyValue(keys, kQuantSinks);
  return " quant=" + format + "/" + Int(group) + "/" + Int(StageKeyValue(keys, kQuantRecent)) +
         (rotate != "none" ? " quant_rotate=" + rotate : std::string()) +
         (key_group != group ? " quant_key_group=" + Int(key_group) : std::string()) +
         (values != kSameFormat && values != format ? " quant_values=" + values : std::string()) +
         (sinks != 0.0 ? " quant_sinks=" + Int(sinks) : std::string());
}

std::vector<StagePolicyKey> ExpectedAttentionKeys() {
  const StagePolicyKey share = {.name = kEaKeyDiffShare,
                                .min = 0.0,
                                .max = 1.0,
                                .max_open = true,
                                .default_value = 0.0,
                                .in_stage_canonical_form = true};
  StagePolicyKey recent = share;
  recent.name = kEaRecentShare;
  recent.in_stage_canonical_form = false;
  return {{.name = kEaFuturePositions,
           .type = PolicyKeyType::kInt,
           .min = 1,
           .max = 1 << 30,
           .default_value = 512,
           .in_stage_canonical_form = true},
          {.name = kEaMinQueries,
           .type = PolicyKeyType::kInt,
           .min = 1,
           .max = static_cast<double>(int64_t{1} << 40),
           .default_value = 256,
           .in_stage_canonical_form = true},
          {.name = kEaCovariance,
           .type = PolicyKeyType::kBool,
           .default_value = 1,
           .in_stage_canonical_form = true},
          share,
          recent,
          // KeyDiff's outliers first (ProtectKeyDiffOutliers): z (0 = off) and the share of the
          // evictable tokens the budget keeps that they may take.
          {.name = kEaOutlierZ, .min = 0.0, .max = 100.0, .default_value = 0.0},
          {.name = kEaOutlierShare, .min = 0.0, .max = 1.0, .default_value = 1.0},
          // KeyDiff's scores max-pooled over this many tokens (odd) before the fused rank.
          {.name = kEaKeyDiffPool,
           .type = PolicyKeyType::kInt,
           .min = 1,
           .max = 31,
           .default_value = 1}};
}

void ApplyExpectedAttentionKeys(const StageKeyValues& keys, CompressionPlanOptions* o) {
  o->expected_attention.future_positions =
      static_cast<int64_t>(StageKeyValue(keys, kEaFuturePositions));
  o->expected_attention.use_covariance = StageKeyValue(keys, kEaCovariance) != 0.0;
  o->expected_attention.keydiff_share = StageKeyValue(keys, kEaKeyDiffShare);
  o->expected_attention.recent_share = StageKeyValue(keys, kEaRecentShare);
  o->expected_attention_min_queries = static_cast<int64_t>(StageKeyValue(keys, kEaMinQueries));
}

// " ea=<future positions>/<min queries>", then the covariance and the KeyDiff share only when
// they differ from the default.
std::string ExpectedAttentionCanonicalForm(const StageKeyValues& keys) {
  const double share = StageKeyValue(keys, kEaKeyDiffShare);
  return " ea=" + Int(StageKeyValue(keys, kEaFuturePositions)) + "/" +
         Int(StageKeyValue(keys, kEaMinQueries)) +
         (StageKeyValue(keys, kEaCovariance) == 0.0 ? " ea_covariance=0" : std::string()) +
         (share != 0.0 ? " ea_keydiff_share=" + Num(share) : std::string());
}

}  // namespace internal
}  // namespace kvd::kernels
