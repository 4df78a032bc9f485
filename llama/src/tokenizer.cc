#include "kvd/llama/tokenizer.h"

#include <algorithm>
#include <limits>

#include "kvd/llama/gguf.h"
#include "unicode_tables.h"

namespace kvd::llama {
namespace {

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

bool InRanges(uint32_t cp, const internal::CodepointRange* r, size_t n) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (cp < r[mid].lo) {
      hi = mid;
    } else if (cp > r[mid].hi) {
      lo = mid + 1;
    } else {
      return true;
    }
  }
  return false;
}

bool IsWhiteSpace(uint32_t cp) {  // Unicode White_Space property
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

CharClass Classify(uint32_t cp) {
  if (cp < 0x80) {
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (IsWhiteSpace(cp)) return CharClass::kSpace;
    return CharClass::kOther;
  }
  if (IsWhiteSpace(cp)) return CharClass::kSpace;
  if (InRanges(cp, internal::kLetterRanges, internal::kNumLetterRanges)) return CharClass::kLetter;
  if (InRanges(cp, internal::kNumberRanges, internal::kNumNumberRanges)) return CharClass::kNumber;
  return CharClass::kOther;
}

struct Cp {
  uint32_t cp;
  uint32_t off;  // byte offset in the text
  CharClass cls;
};

// Decodes UTF-8; an invalid byte becomes one "other" code point of its own.
std::vector<Cp> DecodeUtf8(std::string_view s) {
  std::vector<Cp> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    uint32_t cp = 0;
    size_t len = 0;
    if (b0 < 0x80) {
      cp = b0;
      len = 1;
    } else if ((b0 & 0xE0) == 0xC0) {
      cp = b0 & 0x1F;
      len = 2;
    } else if ((b0 & 0xF0) == 0xE0) {
      cp = b0 & 0x0F;
      len = 3;
    } else if ((b0 & 0xF8) == 0xF0) {
      cp = b0 & 0x07;
      len = 4;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if ((b & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (b & 0x3F);
    }
    if (!ok) {
      out.push_back({0xFFFD, static_cast<uint32_t>(i), CharClass::kOther});
      ++i;
      continue;
    }
    out.push_back({cp, static_cast<uint32_t>(i), Classify(cp)});
    i += len;
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's split of cps[begin, end) (end acts as the end of the text), as byte ranges.
void GptSplit(const std::vector<Cp>& cps, size_t begin, size_t end, size_t text_size,
              std::vector<std::pair<size_t, size_t>>* out) {
  auto off = [&](size_t k) { return k < cps.size() ? size_t{cps[k].off} : text_size; };
  auto emit = [&](size_t a, size_t b) { out->emplace_back(off(a), off(b)); };
  auto run = [&](size_t j, CharClass k) {
    while (j < end && cps[j].cls == k) ++j;
    return j;
  };
  size_t i = begin;
  while (i < end) {
    const uint32_t c = cps[i].cp;
    // 's|'t|'re|'ve|'m|'ll|'d
    if (c == '\'' && i + 1 < end) {
      const uint32_t n1 = cps[i + 1].cp;
      if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
        emit(i, i + 2);
        i += 2;
        continue;
      }
      if (i + 2 < end) {
        const uint32_t n2 = cps[i + 2].cp;
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
          emit(i, i + 3);
          i += 3;
          continue;
        }
      }
    }
    // ' ?\p{L}+' | ' ?\p{N}+' | ' ?[^\s\p{L}\p{N}]+'
    const size_t s = (c == ' ') ? i + 1 : i;
    if (s < end && cps[s].cls != CharClass::kSpace) {
      const size_t j = run(s, cps[s].cls);
      emit(i, j);
      i = j;
      continue;
    }
    // '\s+(?!\S)' then '\s+'
    const size_t j = run(i, CharClass::kSpace);
    if (j < end && j - i > 1) {
      emit(i, j - 1);
      i = j - 1;
    } else {
      emit(i, j);
      i = j;
    }
  }
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& g) {
  const StatusOr<std::string> model = g.GetString("tokenizer.ggml.model");
  if (!model.ok()) return model.status();
  if (*model != "gpt2") {
    return Status::Unimplemented("tokenizer model '" + *model +
                                 "' is not supported (only 'gpt2' byte-level BPE)");
  }
  std::string pre = "default";
  if (g.Find("tokenizer.ggml.pre") != nullptr) {
    KVD_ASSIGN_OR_RETURN(pre, g.GetString("tokenizer.ggml.pre"));
  }
  auto strings = [&](const char* key, bool required, std::vector<std::string>* out) -> Status {
    const GgufValue* v = g.Find(key);
    if (v == nullptr) {
      return required ? Status::InvalidArgument(std::string("GGUF lacks ") + key) : Status::Ok();
    }
    if (v->type != GgufType::kArray || v->array_type != GgufType::kString) {
      return Status::InvalidArgument(std::string(key) + " is not an array of strings");
    }
    out->reserve(v->array.size());
    for (const GgufValue& e : v->array) out->push_back(std::get<std::string>(e.scalar));
    return Status::Ok();
  };
  std::vector<std::string> tokens, merges;
  KVD_RETURN_IF_ERROR(strings("tokenizer.ggml.tokens", true, &tokens));
  KVD_RETURN_IF_ERROR(strings("tokenizer.ggml.merges", true, &merges));
  std::vector<int32_t> types;
  if (const GgufValue* v = g.Find("tokenizer.ggml.token_type")) {
    if (v->type != GgufType::kArray ||
        !(v->array_type == GgufType::kInt32 || v->array_type == GgufType::kUint32)) {
      return Status::InvalidArgument("tokenizer.ggml.token_type is not an int32 array");
    }
    for (const GgufValue& e : v->array) {
      types.push_back(std::holds_alternative<int64_t>(e.scalar)
                          ? static_cast<int32_t>(std::get<int64_t>(e.scalar))
                          : static_cast<int32_t>(std::get<uint64_t>(e.scalar)));
    }
  }
  KVD_ASSIGN_OR_RETURN(int64_t bos, g.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  KVD_ASSIGN_OR_RETURN(int64_t eos, g.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  return Create(std::move(tokens), std::move(types), merges, pre, static_cast<int>(bos),
                static_cast<int>(eos));
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(std::vector<std::string> tokens,
                                                       std::vector<int32_t> types,
                                                       const std::vector<std::string>& merges,
                                                       std::string pre, int bos, int eos) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "codeshell") {
    t->split_digits_ = true;
  } else if (pre != "gpt2" && pre != "default") {
    return Status::Unimplemented("pre-tokenizer '" + pre +
                                 "' is not supported (gpt2, default, smollm, starcoder, refact, "
                                 "codeshell)");
  }
  if (tokens.empty()) return Status::InvalidArgument("empty vocabulary");
  if (!types.empty() && types.size() != tokens.size()) {
    return Status::InvalidArgument("token_type has " + std::to_string(types.size()) +
                                   " entries for " + std::to_string(tokens.size()) + " tokens");
  }
  if (types.empty()) types.assign(tokens.size(), kNormal);
  const int n = static_cast<int>(tokens.size());
  if (bos >= n || eos >= n) {
    return Status::InvalidArgument("bos/eos id outside the vocabulary of " + std::to_string(n));
  }
  t->tokens_ = std::move(tokens);
  t->types_ = std::move(types);
  t->pre_ = std::move(pre);
  t->bos_ = bos;
  t->eos_ = eos;
  t->token_to_id_.reserve(t->tokens_.size());
  for (int i = 0; i < n; ++i) {
    t->token_to_id_.emplace(t->tokens_[i], i);  // first id wins on duplicates
    if ((t->types_[i] == kControl || t->types_[i] == kUserDefined) && !t->tokens_[i].empty()) {
      t->specials_.emplace_back(t->tokens_[i], i);
    }
  }
  std::stable_sort(t->specials_.begin(), t->specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  t->merge_rank_.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos || sp + 1 >= m.size()) {
      return Status::InvalidArgument("merge " + std::to_string(r) + " '" + m +
                                     "' is not 'left right'");
    }
    t->merge_rank_.emplace(m, static_cast<int32_t>(r));
  }
  // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest for 256 + k.
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
    AppendUtf8(cp, &t->byte_to_unicode_[b]);
    t->unicode_to_byte_[cp] = static_cast<uint8_t>(b);
  }
  return t;
}

int32_t Tokenizer::Find(std::string_view token_text) const {
  auto it = token_to_id_.find(std::string(token_text));
  return it == token_to_id_.end() ? -1 : it->second;
}

std::vector<std::string_view> Tokenizer::PreTokenize(std::string_view text) const {
  const std::vector<Cp> cps = DecodeUtf8(text);
  std::vector<std::pair<size_t, size_t>> ranges;
  if (split_digits_) {
    size_t seg = 0;
    for (size_t k = 0; k < cps.size(); ++k) {
      if (cps[k].cls != CharClass::kNumber) continue;
      GptSplit(cps, seg, k, text.size(), &ranges);
      GptSplit(cps, k, k + 1, text.size(), &ranges);
      seg = k + 1;
    }
    GptSplit(cps, seg, cps.size(), text.size(), &ranges);
  } else {
    GptSplit(cps, 0, cps.size(), text.size(), &ranges);
  }
  std::vector<std::string_view> out;
  out.reserve(ranges.size());
  for (auto [a, b] : ranges) {
    if (b > a) out.push_back(text.substr(a, b - a));
  }
  return out;
}

void Tokenizer::Bpe(std::string_view piece, std::vector<int32_t>* out) const {
  std::vector<std::string> sym;
  sym.reserve(piece.size());
  for (char ch : piece) sym.push_back(byte_to_unicode_[static_cast<uint8_t>(ch)]);
  std::string key;
  while (sym.size() > 1) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t best_i = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      key.assign(sym[i]).append(" ").append(sym[i + 1]);
      auto it = merge_rank_.find(key);
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        best_i = i;
      }
    }
    if (best == std::numeric_limits<int32_t>::max()) break;
    // Merge every non-overlapping occurrence of the best pair, left to right (GPT-2's bpe()).
    const std::string left = sym[best_i], right = sym[best_i + 1];
    std::vector<std::string> merged;
    merged.reserve(sym.size());
    for (size_t i = 0; i < sym.size();) {
      if (i + 1 < sym.size() && sym[i] == left && sym[i + 1] == right) {
        merged.push_back(left + right);
        i += 2;
      } else {
        merged.push_back(std::move(sym[i]));
        ++i;
      }
    }
    sym.swap(merged);
  }
  for (const std::string& s : sym) {
    auto it = token_to_id_.find(s);
    if (it != token_to_id_.end()) {
      out->push_back(it->second);
      continue;
    }
    // Not in the vocabulary (a vocabulary without every byte): fall back to the byte tokens.
    const std::vector<Cp> cps = DecodeUtf8(s);
    for (const Cp& c : cps) {
      std::string one;
      AppendUtf8(c.cp, &one);
      auto jt = token_to_id_.find(one);
      if (jt != token_to_id_.end()) out->push_back(jt->second);
    }
  }
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> ids;
  auto encode_plain = [&](std::string_view part) {
    for (std::string_view piece : PreTokenize(part)) Bpe(piece, &ids);
  };
  if (!parse_special || specials_.empty()) {
    encode_plain(text);
    return ids;
  }
  size_t start = 0, i = 0;
  while (i < text.size()) {
    int32_t hit = -1;
    size_t len = 0;
    for (const auto& [s, id] : specials_) {  // longest first
      if (text.compare(i, s.size(), s) == 0) {
        hit = id;
        len = s.size();
        break;
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    encode_plain(text.substr(start, i - start));
    ids.push_back(hit);
    i += len;
    start = i;
  }
  encode_plain(text.substr(start));
  return ids;
}

StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids, bool render_special) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      return Status::OutOfRange("token id " + std::to_string(id) + " outside the vocabulary of " +
                                std::to_string(vocab_size()));
    }
    const std::string& t = tokens_[id];
    if (types_[id] == kControl || types_[id] == kUserDefined) {
      if (render_special || types_[id] == kUserDefined) out += t;
      continue;
    }
    for (const Cp& c : DecodeUtf8(t)) {
      auto it = unicode_to_byte_.find(c.cp);
      if (it != unicode_to_byte_.end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        AppendUtf8(c.cp, &out);
      }
    }
  }
  return out;
}

}  // namespace kvd::llama
