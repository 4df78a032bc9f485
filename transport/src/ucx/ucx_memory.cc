// UcxTransport: registered memory and one-sided access (RMA).
#include <cstring>
#include <string>

#include "ucx/ucx_transport.h"

namespace kvd::transport::ucx {
namespace {

// ExportRegion bytes: magic, base address, size, then the packed UCX remote key.
constexpr std::string_view kRegionMagic = "KVDUCXR1";
constexpr size_t kRegionHeader = 8 + 8 + 8;

void PutU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
uint64_t GetU64(std::string_view in, size_t off) {
  uint64_t v;
  std::memcpy(&v, in.data() + off, 8);
  return v;
}

}  // namespace

StatusOr<Region> UcxTransport::AllocateRegistered(size_t bytes, MemoryType type) {
  if (bytes == 0) return Status::InvalidArgument("AllocateRegistered of 0 bytes");
  if (type == MemoryType::kCuda && !caps_.cuda_memory) {
    return Status::Unimplemented("this UCX was built without CUDA support: cannot allocate " +
                                 std::string(MemoryTypeName(type)) + " memory");
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  params.memory_type = type == MemoryType::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  std::lock_guard<std::mutex> lock(mu_);
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &params, &memh);
  if (s != UCS_OK) {
    Status st = Err(s, "ucp_mem_map(ALLOCATE, " + std::to_string(bytes) + " bytes)");
    if (st.code() == StatusCode::kInternal || st.code() == StatusCode::kUnavailable) {
      st = Status::ResourceExhausted(st.message());
    }
    return st;
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return Err(s, "ucp_mem_query");
  }
  uint64_t id = next_id_++;
  regions_[id] = RegionState{memh, attr.address, bytes, /*owned=*/true};
  return Region{RegionHandle{id}, attr.address, bytes, type};
}

StatusOr<Region> UcxTransport::RegisterMemory(void* data, size_t bytes, MemoryType type) {
  if (data == nullptr) return Status::InvalidArgument("RegisterMemory of a null pointer");
  if (bytes == 0) return Status::InvalidArgument("RegisterMemory of 0 bytes");
  if (type == MemoryType::kCuda && !caps_.cuda_memory) {
    return Status::Unimplemented("this UCX was built without CUDA support: cannot register " +
                                 std::string(MemoryTypeName(type)) + " memory");
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = data;
  params.length = bytes;
  params.memory_type = type == MemoryType::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  std::lock_guard<std::mutex> lock(mu_);
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &params, &memh);
  if (s != UCS_OK) return Err(s, "ucp_mem_map(" + std::to_string(bytes) + " bytes)");
  uint64_t id = next_id_++;
  regions_[id] = RegionState{memh, data, bytes, /*owned=*/false};
  return Region{RegionHandle{id}, data, bytes, type};
}

Status UcxTransport::DeregisterMemory(RegionHandle region) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end()) return Status::NotFound("unknown region " + std::to_string(region.id));
  ucs_status_t s = ucp_mem_unmap(context_, it->second.memh);
  regions_.erase(it);
  return Err(s, "ucp_mem_unmap");
}

StatusOr<std::string> UcxTransport::ExportRegion(RegionHandle region) {
  if (!caps_.rma) return Status::Unimplemented("RMA is disabled (TransportOptions.enable_rma)");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end()) return Status::NotFound("unknown region " + std::to_string(region.id));
  void* rkey_buf = nullptr;
  size_t rkey_size = 0;
  ucs_status_t s = ucp_rkey_pack(context_, it->second.memh, &rkey_buf, &rkey_size);
  if (s != UCS_OK) return Err(s, "ucp_rkey_pack");
  std::string out(kRegionMagic);
  PutU64(out, reinterpret_cast<uint64_t>(it->second.data));
  PutU64(out, it->second.size);
  out.append(static_cast<const char*>(rkey_buf), rkey_size);
  ucp_rkey_buffer_release(rkey_buf);
  return out;
}

StatusOr<RemoteRegionHandle> UcxTransport::ImportRegion(PeerHandle peer,
                                                        std::string_view exported) {
  if (!caps_.rma) return Status::Unimplemented("RMA is disabled (TransportOptions.enable_rma)");
  if (exported.size() <= kRegionHeader || exported.substr(0, 8) != kRegionMagic) {
    return Status::InvalidArgument("not a UCX region export (" + std::to_string(exported.size()) +
                                   " bytes without the KVDUCXR1 prefix)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto p = peers_.find(peer.id);
  if (p == peers_.end()) return Status::NotFound("unknown peer " + std::to_string(peer.id));
  if (!p->second.failure.ok()) return p->second.failure;
  std::string rkey_bytes(exported.substr(kRegionHeader));
  ucp_rkey_h rkey = nullptr;
  ucs_status_t s = ucp_ep_rkey_unpack(p->second.ep, rkey_bytes.data(), &rkey);
  if (s != UCS_OK) return Err(s, "ucp_ep_rkey_unpack");
  uint64_t id = next_id_++;
  remotes_[id] = RemoteRegion{peer.id, rkey, GetU64(exported, 8), GetU64(exported, 16)};
  return RemoteRegionHandle{id};
}

Status UcxTransport::ReleaseRemoteRegion(RemoteRegionHandle remote) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = remotes_.find(remote.id);
  if (it == remotes_.end()) {
    return Status::NotFound("unknown remote region " + std::to_string(remote.id));
  }
  ucp_rkey_destroy(it->second.rkey);
  remotes_.erase(it);
  return Status::Ok();
}

Status UcxTransport::PostRmaLocked(uint64_t id, Transfer& t, const TransferRequest& r) {
  auto rit = remotes_.find(r.remote.id);
  if (rit == remotes_.end()) {
    return Status::NotFound("unknown remote region " + std::to_string(r.remote.id));
  }
  const RemoteRegion& rr = rit->second;
  if (rr.peer != r.peer.id) {
    return Status::InvalidArgument("remote region " + std::to_string(r.remote.id) +
                                   " was imported for another peer");
  }
  if (r.remote_offset > rr.size || r.length > rr.size - r.remote_offset) {
    return Status::OutOfRange("RMA [" + std::to_string(r.remote_offset) + ", +" +
                              std::to_string(r.length) + ") beyond the remote region of " +
                              std::to_string(rr.size) + " bytes");
  }
  ucp_ep_h ep = peers_[r.peer.id].ep;
  const uint64_t remote_addr = rr.base + r.remote_offset;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = this;
  param.cb.send = &UcxTransport::SendCallback;
  ucs_status_ptr_t req;
  if (r.op == TransferOp::kRead) {
    if (r.memory_type == MemoryType::kCuda) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      param.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    req = ucp_get_nbx(ep, r.buffer, r.length, remote_addr, rr.rkey, &param);
  } else {
    // A put completes locally when the source may be reused; the flush after it completes when
    // the bytes are in the remote memory, which is what kDone promises.
    ucp_request_param_t put_param{};
    if (r.memory_type == MemoryType::kCuda) {
      put_param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      put_param.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    ucs_status_ptr_t put = ucp_put_nbx(ep, r.buffer, r.length, remote_addr, rr.rkey, &put_param);
    if (UCS_PTR_IS_ERR(put)) return Err(UCS_PTR_STATUS(put), "ucp_put_nbx");
    if (put != nullptr) ucp_request_free(put);
    req = ucp_ep_flush_nbx(ep, &param);
  }
  if (UCS_PTR_IS_ERR(req)) return Err(UCS_PTR_STATUS(req), std::string(TransferOpName(r.op)));
  if (req == nullptr) {
    t.status = {TransferState::kDone, Status::Ok(), r.length};
    return Status::Ok();
  }
  if (t.callback_ran) return Status::Ok();  // completed (and freed) inside the call
  RequestId(req) = id;
  t.request = req;
  return Status::Ok();
}

}  // namespace kvd::transport::ucx
