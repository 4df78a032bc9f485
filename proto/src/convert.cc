#include "kvd/proto/convert.h"

#include <string>

#include "kvd/common/utf8.h"

namespace kvd::proto {

void ToProto(const kvd::ModelLayout& l, ModelLayout::Builder out) {
  out.setNumLayers(static_cast<uint32_t>(l.num_layers));
  out.setNumKvHeads(static_cast<uint32_t>(l.num_kv_heads));
  out.setNumQHeads(static_cast<uint32_t>(l.num_q_heads));
  out.setHeadDim(static_cast<uint32_t>(l.head_dim));
  out.setDtype(static_cast<DType>(l.dtype));
  out.setTpRank(static_cast<uint32_t>(l.tp_rank));
  out.setTpSize(static_cast<uint32_t>(l.tp_size));
  auto r = out.initRope();
  r.setTheta(l.rope.theta);
  r.setRotaryDim(static_cast<uint32_t>(l.rope.rotary_dim));
  r.setPairing(l.rope.pairing == kvd::RopePairing::kHalves ? RopeConfig::Pairing::HALVES
                                                           : RopeConfig::Pairing::INTERLEAVED);
  r.setScaling(static_cast<RopeConfig::Scaling>(l.rope.scaling));
  r.setFactor(l.rope.factor);
  r.setLowFreqFactor(l.rope.low_freq_factor);
  r.setHighFreqFactor(l.rope.high_freq_factor);
  r.setOriginalMaxPositions(static_cast<uint32_t>(l.rope.original_max_positions));
}

StatusOr<kvd::ModelLayout> FromProto(ModelLayout::Reader in) {
  kvd::ModelLayout l;
  auto small = [](uint32_t v, const char* name, int* out) -> Status {
    if (v > 1u << 20)
      return Status::InvalidArgument(std::string(name) + " out of range: " + std::to_string(v));
    *out = static_cast<int>(v);
    return Status::Ok();
  };
  KVD_RETURN_IF_ERROR(small(in.getNumLayers(), "num_layers", &l.num_layers));
  KVD_RETURN_IF_ERROR(small(in.getNumKvHeads(), "num_kv_heads", &l.num_kv_heads));
  KVD_RETURN_IF_ERROR(small(in.getNumQHeads(), "num_q_heads", &l.num_q_heads));
  KVD_RETURN_IF_ERROR(small(in.getHeadDim(), "head_dim", &l.head_dim));
  KVD_RETURN_IF_ERROR(small(in.getTpRank(), "tp_rank", &l.tp_rank));
  KVD_RETURN_IF_ERROR(small(in.getTpSize(), "tp_size", &l.tp_size));
  auto dtype = static_cast<uint16_t>(in.getDtype());
  if (dtype > 2) return Status::InvalidArgument("unknown dtype enum " + std::to_string(dtype));
  l.dtype = static_cast<kvd::DType>(dtype);
  auto r = in.getRope();
  l.rope.theta = r.getTheta();
  KVD_RETURN_IF_ERROR(small(r.getRotaryDim(), "rope.rotary_dim", &l.rope.rotary_dim));
  auto pairing = static_cast<uint16_t>(r.getPairing());
  if (pairing > 1)
    return Status::InvalidArgument("unknown rope pairing enum " + std::to_string(pairing));
  l.rope.pairing = pairing == 1 ? kvd::RopePairing::kHalves : kvd::RopePairing::kInterleaved;
  auto scaling = static_cast<uint16_t>(r.getScaling());
  if (scaling > 2)
    return Status::InvalidArgument("unknown rope scaling enum " + std::to_string(scaling));
  l.rope.scaling = static_cast<kvd::RopeScaling>(scaling);
  l.rope.factor = r.getFactor();
  l.rope.low_freq_factor = r.getLowFreqFactor();
  l.rope.high_freq_factor = r.getHighFreqFactor();
  KVD_RETURN_IF_ERROR(small(r.getOriginalMaxPositions(), "rope.original_max_positions",
                            &l.rope.original_max_positions));
  KVD_RETURN_IF_ERROR(l.Validate());
  return l;
}

void ToProto(const kvd::Hash128& h, Hash128::Builder out) {
  out.setHi(h.hi);
  out.setLo(h.lo);
}
kvd::Hash128 FromProto(Hash128::Reader in) { return kvd::Hash128{in.getHi(), in.getLo()}; }

std::string ValidUtf8(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    if (const size_t n = kvd::Utf8SequenceBytes(in, i); n > 0) {
      out.append(in.substr(i, n));
      i += n;
    } else {
      out += "\xef\xbf\xbd";  // U+FFFD for the one bad byte; resynchronise on the next
      ++i;
    }
  }
  return out;
}

void ToProto(const kvd::Status& s, Error::Builder out) {
  out.setCode(static_cast<uint16_t>(s.code()));
  // Messages may echo client input (names, Cap'n Proto exception text): the wire carries valid
  // UTF-8 only (Cap'n Proto Text), bad bytes become U+FFFD. The length is given: NUL is valid
  // UTF-8, and a std::string converted implicitly would end at its first NUL (c_str()).
  const std::string message = ValidUtf8(s.message());
  out.setMessage(kj::StringPtr(message.c_str(), message.size()));
  out.setReason(static_cast<uint16_t>(s.reason()));
}

kvd::Status FromProto(Error::Reader in) {
  uint16_t code = in.getCode();
  // A daemon of another build may send any bytes: the caller gets valid UTF-8 as well.
  const kj::StringPtr text = in.getMessage();
  std::string message = ValidUtf8(std::string_view(text.cStr(), text.size()));
  if (code == 0 || code > static_cast<uint16_t>(kvd::StatusCode::kPermissionDenied)) {
    return kvd::Status::Internal("unknown error code " + std::to_string(code) + ": " + message);
  }
  const uint16_t reason = in.getReason();  // one this build does not know: none
  return kvd::Status(static_cast<kvd::StatusCode>(code), message,
                     reason <= static_cast<uint16_t>(kvd::Reason::kQuotaExceeded)
                         ? static_cast<kvd::Reason>(reason)
                         : kvd::Reason::kNone);
}

}  // namespace kvd::proto
