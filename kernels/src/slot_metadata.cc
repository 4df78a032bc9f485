// Slot metadata of compact chunk format v2 (docs/chunk-format.md "Slot metadata").
//
// A list of n unsigned values (n known to the reader) is written as List(values):
//   1 bit mode
//   mode 0 (plain): Gamma(ZigZag(k - k_prev)), then n x Rice(value, k)
//   mode 1 (zero runs): Gamma(ZigZag(kz - kz_prev)), Gamma(ZigZag(kv - kv_prev)), then until n
//     values are read: Rice(z, kz) = the number of zeros that follow; if values remain,
//     Rice(value - 1, kv) for the nonzero value after them.
// The writer picks the mode and parameters that make the list shortest (mode 0 on ties), so runs
// of equal slots (contiguous tokens, groups of the same size) cost a few bits per run.
//
// Per head, in this order:
//   Gamma(ZigZag(S - S_prev))                        slot count
//   1 bit  cardinalities present (0: every l_j == 1)
//   1 bit  rebuild flags present (only when the codec has a route stage; 0: none set)
//   when S > 0:
//     if cardinalities present:
//       1 bit: 0 codes l_j - 1, 1 codes ZigZag(l_j - l_{j-1}) with l_{-1} = 1; then List of them
//     1 bit: 0 codes r_j, 1 codes ZigZag(r_j), where
//       r_j = pos_j - (pos_{j-1} + l_j), pos_{-1} = position_base - 1  (mod 2^64)
//       i.e. the tokens skipped before slot j when slots are ascending, disjoint groups whose
//       position is their last token: 0 for every slot of a contiguous run, whatever l_j is;
//       then List of them
//     if rebuild flags present:
//       Gamma(ZigZag(R - R_prev)), R >= 1 slots flagged; List of the R gaps: gap_0 = index_0,
//       gap_i = index_i - index_{i-1} - 1.
// Each _prev is the previous head's value of the same field (0 before the first head); each
// 1-bit choice is the shorter one (0 on ties).
#include "slot_metadata.h"

#include <limits>
#include <string>
#include <vector>

namespace kvd::kernels::internal {
namespace {

void PutParameter(uint64_t value, uint64_t* previous, BitWriter* out) {
  out->PutGamma(ZigZag(static_cast<int64_t>(value - *previous)));
  *previous = value;
}

bool GetParameter(BitReader* in, uint64_t* previous, uint64_t* value) {
  uint64_t z;
  if (!in->GetGamma(&z)) return false;
  *value = *previous + static_cast<uint64_t>(UnZigZag(z));
  *previous = *value;
  return true;
}

int64_t ParameterBits(uint64_t value, uint64_t previous) {
  return GammaBits(ZigZag(static_cast<int64_t>(value - previous)));
}

// How List(values) is written (file comment): the shorter mode with its best parameters.
struct ListPlan {
  bool zero_runs_mode = false;
  int k = 0, zero_run_k = 0, value_k = 0;
  std::vector<uint64_t> zero_runs, nonzero;  // zero-run mode: nonzero holds value - 1
  int64_t bits = 0;                          // parameters and values, not the mode bit
};

ListPlan PlanList(const std::vector<uint64_t>& values, const ListParameters& previous) {
  ListPlan plan;
  plan.k = BestRiceParameter(values, &plan.bits);
  plan.bits += ParameterBits(plan.k, previous.k);

  ListPlan runs;
  runs.zero_runs_mode = true;
  uint64_t run = 0;
  for (uint64_t v : values) {
    if (v == 0) {
      ++run;
      continue;
    }
    runs.zero_runs.push_back(run);
    runs.nonzero.push_back(v - 1);
    run = 0;
  }
  if (run > 0) runs.zero_runs.push_back(run);
  int64_t run_bits, value_bits;
  runs.zero_run_k = BestRiceParameter(runs.zero_runs, &run_bits);
  runs.value_k = BestRiceParameter(runs.nonzero, &value_bits);
  runs.bits = run_bits + value_bits + ParameterBits(runs.zero_run_k, previous.zero_run_k) +
              ParameterBits(runs.value_k, previous.value_k);
  return runs.bits < plan.bits ? runs : plan;
}

void PutList(const std::vector<uint64_t>& values, ListParameters* p, BitWriter* out) {
  const ListPlan plan = PlanList(values, *p);
  out->PutBit(plan.zero_runs_mode);
  if (!plan.zero_runs_mode) {
    PutParameter(static_cast<uint64_t>(plan.k), &p->k, out);
    for (uint64_t v : values) out->PutRice(v, plan.k);
    return;
  }
  PutParameter(static_cast<uint64_t>(plan.zero_run_k), &p->zero_run_k, out);
  PutParameter(static_cast<uint64_t>(plan.value_k), &p->value_k, out);
  for (size_t i = 0; i < plan.zero_runs.size() || i < plan.nonzero.size(); ++i) {
    // A list ending in a nonzero value has no final (empty) run of zeros.
    if (i < plan.zero_runs.size()) out->PutRice(plan.zero_runs[i], plan.zero_run_k);
    if (i < plan.nonzero.size()) out->PutRice(plan.nonzero[i], plan.value_k);
  }
}

Status Corrupt(const std::string& what) { return Status::DataLoss(what); }
Status OutOfBits(const char* field) {
  return Status::DataLoss(std::string("slot metadata ends inside the ") + field);
}

Status GetRiceParameter(BitReader* in, uint64_t* previous, int* k, const char* field) {
  uint64_t v;
  if (!GetParameter(in, previous, &v)) return OutOfBits(field);
  if (v > static_cast<uint64_t>(kMaxRiceParameter)) {
    return Corrupt(std::string("Rice parameter ") + std::to_string(v) + " of the " + field +
                   " is above " + std::to_string(kMaxRiceParameter));
  }
  *k = static_cast<int>(v);
  return Status::Ok();
}

// Reads List(values) of `n` values (file comment) into *values.
Status GetList(BitReader* in, uint64_t n, ListParameters* p, const char* field,
               std::vector<uint64_t>* values) {
  values->assign(n, 0);
  bool zero_runs_mode;
  if (!in->GetBit(&zero_runs_mode)) return OutOfBits(field);
  if (!zero_runs_mode) {
    int k;
    KVD_RETURN_IF_ERROR(GetRiceParameter(in, &p->k, &k, field));
    for (uint64_t& v : *values) {
      if (!in->GetRice(k, &v)) return OutOfBits(field);
    }
    return Status::Ok();
  }
  int zero_run_k, value_k;
  KVD_RETURN_IF_ERROR(GetRiceParameter(in, &p->zero_run_k, &zero_run_k, field));
  KVD_RETURN_IF_ERROR(GetRiceParameter(in, &p->value_k, &value_k, field));
  for (uint64_t j = 0; j < n;) {
    uint64_t run, v;
    if (!in->GetRice(zero_run_k, &run)) return OutOfBits(field);
    if (run > n - j) {
      return Corrupt(std::string("a run of ") + std::to_string(run) + " zeros in the " + field +
                     " passes its " + std::to_string(n) + " values");
    }
    j += run;
    if (j == n) break;
    if (!in->GetRice(value_k, &v)) return OutOfBits(field);
    (*values)[j++] = v + 1;  // v + 1 == 0 (v = 2^64 - 1) is caught where the value is used
  }
  return Status::Ok();
}

}  // namespace

void EncodeSlotMetadata(const CompactHead& head, bool has_route, int64_t position_base,
                        SlotCodingState* state, BitWriter* out) {
  const size_t s = head.flags.size();
  PutParameter(s, &state->slots, out);
  bool any_cardinality = false, any_rebuild = false;
  for (size_t j = 0; j < s; ++j) {
    any_cardinality |= head.cardinality[j] != 1;
    any_rebuild |= (head.flags[j] & kSlotRebuildValue) != 0;
  }
  out->PutBit(any_cardinality);
  if (has_route) out->PutBit(any_rebuild);
  if (s == 0) return;

  if (any_cardinality) {
    std::vector<uint64_t> plain(s), delta(s);
    int64_t previous = 1;
    for (size_t j = 0; j < s; ++j) {
      plain[j] = static_cast<uint64_t>(head.cardinality[j] - 1);
      delta[j] = ZigZag(head.cardinality[j] - previous);
      previous = head.cardinality[j];
    }
    const bool use_delta =
        PlanList(delta, state->cardinality).bits < PlanList(plain, state->cardinality).bits;
    out->PutBit(use_delta);
    PutList(use_delta ? delta : plain, &state->cardinality, out);
  }

  std::vector<uint64_t> residual(s);
  bool ascending = true;
  uint64_t previous = static_cast<uint64_t>(position_base) - 1;
  for (size_t j = 0; j < s; ++j) {
    const uint64_t pos = static_cast<uint64_t>(head.positions[j]);
    residual[j] = pos - (previous + static_cast<uint64_t>(head.cardinality[j]));
    ascending &= static_cast<int64_t>(residual[j]) >= 0;
    previous = pos;
  }
  out->PutBit(!ascending);
  if (!ascending) {
    for (uint64_t& r : residual) r = ZigZag(static_cast<int64_t>(r));
  }
  PutList(residual, &state->position, out);

  if (any_rebuild) {
    std::vector<uint64_t> gaps;
    size_t next = 0;  // the first index the next flagged slot may have
    for (size_t j = 0; j < s; ++j) {
      if (!(head.flags[j] & kSlotRebuildValue)) continue;
      gaps.push_back(j - next);
      next = j + 1;
    }
    PutParameter(gaps.size(), &state->rebuild_count, out);
    PutList(gaps, &state->rebuild, out);
  }
}

Status DecodeSlotMetadata(BitReader* in, bool has_route, int64_t position_base, uint64_t max_slots,
                          SlotCodingState* state, CompactHead* head) {
  uint64_t s;
  if (!GetParameter(in, &state->slots, &s)) return OutOfBits("slot count");
  if (s > max_slots) {
    return Corrupt(std::to_string(s) + " slots, more than the data section holds (" +
                   std::to_string(max_slots) + ")");
  }
  bool any_cardinality = false, any_rebuild = false;
  if (!in->GetBit(&any_cardinality)) return OutOfBits("presence bits");
  if (has_route && !in->GetBit(&any_rebuild)) return OutOfBits("presence bits");
  head->flags.assign(s, 0);
  head->cardinality.assign(s, 1);
  head->positions.assign(s, 0);
  if (s == 0) return Status::Ok();

  std::vector<uint64_t> list;
  constexpr int64_t kMaxCardinality = std::numeric_limits<int32_t>::max();
  if (any_cardinality) {
    bool use_delta;
    if (!in->GetBit(&use_delta)) return OutOfBits("cardinalities");
    KVD_RETURN_IF_ERROR(GetList(in, s, &state->cardinality, "cardinalities", &list));
    int64_t previous = 1;
    for (uint64_t j = 0; j < s; ++j) {
      int64_t l = 0;  // stays 0 (rejected below) when the coded value is out of range
      if (use_delta) {
        const int64_t d = UnZigZag(list[j]);
        if (d <= kMaxCardinality && d >= -kMaxCardinality) l = previous + d;
      } else if (list[j] < static_cast<uint64_t>(kMaxCardinality)) {
        l = static_cast<int64_t>(list[j]) + 1;
      }
      if (l < 1 || l > kMaxCardinality) {
        return Corrupt("cardinality out of [1, 2^31) at slot " + std::to_string(j));
      }
      head->cardinality[j] = static_cast<int32_t>(l);
      previous = l;
    }
  }

  bool zigzag;
  if (!in->GetBit(&zigzag)) return OutOfBits("positions");
  KVD_RETURN_IF_ERROR(GetList(in, s, &state->position, "positions", &list));
  uint64_t previous = static_cast<uint64_t>(position_base) - 1;
  for (uint64_t j = 0; j < s; ++j) {
    const uint64_t residual = zigzag ? static_cast<uint64_t>(UnZigZag(list[j])) : list[j];
    const uint64_t pos = previous + static_cast<uint64_t>(head->cardinality[j]) + residual;
    if (static_cast<int64_t>(pos) < 0) {
      return Corrupt("negative position at slot " + std::to_string(j));
    }
    head->positions[j] = static_cast<int64_t>(pos);
    previous = pos;
  }

  if (any_rebuild) {
    uint64_t count;
    if (!GetParameter(in, &state->rebuild_count, &count)) return OutOfBits("rebuild flags");
    if (count < 1 || count > s) {
      return Corrupt(std::to_string(count) + " rebuild slots, expected 1.." + std::to_string(s));
    }
    KVD_RETURN_IF_ERROR(GetList(in, count, &state->rebuild, "rebuild flags", &list));
    uint64_t next = 0;  // the first index the next flagged slot may have
    for (uint64_t i = 0; i < count; ++i) {
      if (list[i] >= s - next) {
        return Corrupt("rebuild flag " + std::to_string(i) + " beyond the " + std::to_string(s) +
                       " slots");
      }
      head->flags[next + list[i]] = kSlotRebuildValue;
      next += list[i] + 1;
    }
  }
  return Status::Ok();
}

}  // namespace kvd::kernels::internal
