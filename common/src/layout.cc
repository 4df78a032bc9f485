#include "kvd/common/layout.h"

#include <sstream>

#include "kvd/common/hash.h"

namespace kvd {
namespace {
const char* PairingName(RopePairing p) {
  return p == RopePairing::kHalves ? "halves" : "interleaved";
}
const char* ScalingName(RopeScaling s) {
  return s == RopeScaling::kNone ? "none" : s == RopeScaling::kLinear ? "linear" : "llama3";
}
}  // namespace

Status RopeConfig::Validate(int head_dim) const {
  if (!(theta > 0))
    return Status::InvalidArgument("rope.theta must be > 0, got " + std::to_string(theta));
  int rd = rotary_dim == 0 ? head_dim : rotary_dim;
  if (rd < 2 || rd > head_dim || rd % 2 != 0) {
    return Status::InvalidArgument("rope.rotary_dim must be even and in [2, head_dim=" +
                                   std::to_string(head_dim) + "], got " + std::to_string(rd));
  }
  if (scaling == RopeScaling::kLinear && !(factor > 0)) {
    return Status::InvalidArgument("rope.factor must be > 0 for linear scaling");
  }
  if (scaling == RopeScaling::kLlama3) {
    if (!(factor >= 1))
      return Status::InvalidArgument("rope.factor must be >= 1 for llama3 scaling");
    if (!(high_freq_factor > low_freq_factor) || !(low_freq_factor > 0)) {
      return Status::InvalidArgument("llama3 rope needs high_freq_factor > low_freq_factor > 0");
    }
    if (original_max_positions <= 0) {
      return Status::InvalidArgument("llama3 rope needs original_max_positions > 0");
    }
  }
  return Status::Ok();
}

Status ModelLayout::Validate() const {
  if (num_layers <= 0 || num_layers > 1024)
    return Status::InvalidArgument("num_layers must be in [1, 1024], got " +
                                   std::to_string(num_layers));
  if (num_kv_heads <= 0 || num_kv_heads > 1024)
    return Status::InvalidArgument("num_kv_heads must be in [1, 1024], got " +
                                   std::to_string(num_kv_heads));
  if (num_q_heads < num_kv_heads || num_q_heads % num_kv_heads != 0) {
    return Status::InvalidArgument("num_q_heads (" + std::to_string(num_q_heads) +
                                   ") must be a positive multiple of num_kv_heads (" +
                                   std::to_string(num_kv_heads) + ")");
  }
  if (head_dim <= 0 || head_dim > 1024 || head_dim % 2)
    return Status::InvalidArgument("head_dim must be even and in [2, 1024], got " +
                                   std::to_string(head_dim));
  if (tp_size <= 0 || tp_rank < 0 || tp_rank >= tp_size) {
    return Status::InvalidArgument("tp_rank must be in [0, tp_size), got " +
                                   std::to_string(tp_rank) + "/" + std::to_string(tp_size));
  }
  return rope.Validate(head_dim);
}

std::string ModelLayout::ToString() const {
  std::ostringstream os;
  os << "layers=" << num_layers << " kv_heads=" << num_kv_heads << " q_heads=" << num_q_heads
     << " head_dim=" << head_dim << " dtype=" << DTypeName(dtype) << " tp=" << tp_rank << "/"
     << tp_size << " rope=" << PairingName(rope.pairing) << "/" << rope.theta << "/"
     << ScalingName(rope.scaling);
  return os.str();
}

std::string ModelLayout::DescribeMismatch(const ModelLayout& o) const {
  auto field = [](const char* name, auto a, auto b) {
    std::ostringstream os;
    os << name << ": registered " << a << ", client sent " << b;
    return os.str();
  };
  if (num_layers != o.num_layers) return field("num_layers", num_layers, o.num_layers);
  if (num_kv_heads != o.num_kv_heads) return field("num_kv_heads", num_kv_heads, o.num_kv_heads);
  if (num_q_heads != o.num_q_heads) return field("num_q_heads", num_q_heads, o.num_q_heads);
  if (head_dim != o.head_dim) return field("head_dim", head_dim, o.head_dim);
  if (dtype != o.dtype) return field("dtype", DTypeName(dtype), DTypeName(o.dtype));
  if (tp_rank != o.tp_rank) return field("tp_rank", tp_rank, o.tp_rank);
  if (tp_size != o.tp_size) return field("tp_size", tp_size, o.tp_size);
  if (rope.theta != o.rope.theta) return field("rope.theta", rope.theta, o.rope.theta);
  if (rope.rotary_dim != o.rope.rotary_dim)
    return field("rope.rotary_dim", rope.rotary_dim, o.rope.rotary_dim);
  if (rope.pairing != o.rope.pairing)
    return field("rope.pairing", PairingName(rope.pairing), PairingName(o.rope.pairing));
  if (rope.scaling != o.rope.scaling)
    return field("rope.scaling", ScalingName(rope.scaling), ScalingName(o.rope.scaling));
  if (!(rope == o.rope)) return "rope scaling parameters differ";
  return "";
}

uint64_t ModelLayout::Digest() const {
  std::ostringstream os;
  os.precision(17);
  os << "kvd-layout-v1|" << num_layers << '|' << num_kv_heads << '|' << num_q_heads << '|'
     << head_dim << '|' << static_cast<int>(dtype) << '|' << tp_rank << '|' << tp_size << '|'
     << rope.theta << '|' << rope.rotary_dim << '|' << static_cast<int>(rope.pairing) << '|'
     << static_cast<int>(rope.scaling) << '|' << rope.factor << '|' << rope.low_freq_factor << '|'
     << rope.high_freq_factor << '|' << rope.original_max_positions;
  return Digest64(os.str());
}

}  // namespace kvd
