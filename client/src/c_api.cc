// The C ABI (kvd/client/kvd_client.h) over the C++ Client. No exception crosses it.
#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/client/json.h"
#include "kvd/client/kvd_client.h"

struct kvd_client {
  std::unique_ptr<kvd::client::Client> impl;
};
struct kvd_chunk_view {
  kvd::client::ChunkView view;
};
struct kvd_put_slot {
  kvd::client::PutSlot slot;
};
struct kvd_placement {
  kvd::client::PlacementResult result;
};

namespace {

thread_local std::string g_last_error;

int Fail(const kvd::Status& s) {
  g_last_error = s.ToString();
  return static_cast<int>(s.code());
}

int Fail(int code, std::string message) {
  g_last_error = std::move(message);
  return code;
}

// Runs fn (returning int) with exceptions (std::bad_alloc, ...) turned into KVD_INTERNAL.
template <typename Fn>
int Guard(Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Fail(KVD_INTERNAL, std::string("INTERNAL: ") + e.what());
  } catch (...) {
    return Fail(KVD_INTERNAL, "INTERNAL: unknown exception");
  }
}

kvd::Hash128 ToHash(kvd_hash128 h) { return kvd::Hash128{h.hi, h.lo}; }

std::vector<kvd::Hash128> ToChain(const kvd_hash128* chain, size_t length) {
  std::vector<kvd::Hash128> out(length);
  for (size_t i = 0; i < length; ++i) out[i] = ToHash(chain[i]);
  return out;
}

kvd::ModelLayout ToLayout(const kvd_layout& l) {
  kvd::ModelLayout out;
  out.num_layers = l.num_layers;
  out.num_kv_heads = l.num_kv_heads;
  out.num_q_heads = l.num_q_heads;
  out.head_dim = l.head_dim;
  out.dtype = static_cast<kvd::DType>(l.dtype);
  out.tp_rank = l.tp_rank;
  out.tp_size = l.tp_size;
  out.rope.theta = l.rope_theta;
  out.rope.rotary_dim = l.rope_rotary_dim;
  out.rope.pairing = static_cast<kvd::RopePairing>(l.rope_pairing);
  out.rope.scaling = static_cast<kvd::RopeScaling>(l.rope_scaling);
  out.rope.factor = l.rope_factor;
  out.rope.low_freq_factor = l.rope_low_freq_factor;
  out.rope.high_freq_factor = l.rope_high_freq_factor;
  out.rope.original_max_positions = l.rope_original_max_positions;
  return out;
}

char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

#define KVD_C_REQUIRE(cond, what) \
  if (!(cond)) return Fail(KVD_INVALID_ARGUMENT, std::string("INVALID_ARGUMENT: ") + (what))

// Larger than any versioned struct will be: a struct_size beyond it was never set by an init.
constexpr size_t kMaxStructBytes = 4096;

// The versioned structs' sizes: each one's first version with struct_size ends with the field
// named here, so every caller's struct_size is at least this. Fields added later go after it.
constexpr size_t kFirstSizedConfigBytes = offsetof(kvd_config, lease_ttl_ms) + sizeof(uint32_t);
constexpr size_t kFirstSizedLookupResultBytes =
    offsetof(kvd_lookup_result, lease_ttl_ms) + sizeof(uint32_t);
constexpr size_t kFirstSizedGetResultBytes = offsetof(kvd_get_result, tokens) + sizeof(uint32_t);
static_assert(offsetof(kvd_config, struct_size) == 0, "struct_size leads kvd_config");
static_assert(offsetof(kvd_lookup_result, struct_size) == 0, "struct_size leads the result");
static_assert(offsetof(kvd_get_result, struct_size) == 0, "struct_size leads the result");

// INVALID_ARGUMENT naming struct_size unless `size` can be that of a struct `name` (at least
// `first_sized` bytes), i.e. `init` set it.
kvd::Status CheckStructSize(const std::string& name, size_t size, size_t first_sized) {
  if (size >= first_sized && size <= kMaxStructBytes) return kvd::Status::Ok();
  return kvd::Status::InvalidArgument(
      name + ".struct_size is " + std::to_string(size) + ", not the size of a " + name +
      " (at least " + std::to_string(first_sized) + "): call " + name +
      "_init first; a program built against a kvd_client.h without struct_size must be rebuilt");
}

kvd::Status CheckResult(const kvd_lookup_result& r) {
  return CheckStructSize("kvd_lookup_result", r.struct_size, kFirstSizedLookupResultBytes);
}
kvd::Status CheckResult(const kvd_get_result& r) {
  return CheckStructSize("kvd_get_result", r.struct_size, kFirstSizedGetResultBytes);
}

// Writes this library's `value` into the caller's result (its struct_size checked by
// CheckResult): the fields that fit in the caller's struct_size bytes, zero in the caller's
// fields beyond this library's struct; never past struct_size, and struct_size stays.
template <typename T>
void WriteResult(const T& value, T* out) {
  const size_t size = out->struct_size;
  const size_t known = std::min(size, sizeof(T));
  auto* dst = reinterpret_cast<unsigned char*>(out);
  const auto* src = reinterpret_cast<const unsigned char*>(&value);
  constexpr size_t kFirst = sizeof(out->struct_size);
  std::memcpy(dst + kFirst, src + kFirst, known - kFirst);
  if (size > known) std::memset(dst + known, 0, size - known);
}

void WriteResult(const kvd::client::LookupResult& r, kvd_lookup_result* out) {
  kvd_lookup_result v;
  std::memset(&v, 0, sizeof v);  // padding too: every byte written to the caller is defined
  v.matched_chunks = r.matched_chunks;
  v.matched_tokens = r.matched_tokens;
  v.lease_id = r.lease_id;
  v.lease_ttl_ms = r.lease_ttl_ms;
  v.fetched_chunks = r.fetched_chunks;
  v.num_holders = static_cast<uint32_t>(r.holders.size());
  v.membership_current = r.membership_current ? 1 : 0;
  v.membership_age_ms = r.membership_age_ms;
  WriteResult(v, out);
}

void WriteResult(const kvd::client::GetResult& r, kvd_get_result* out) {
  kvd_get_result v;
  std::memset(&v, 0, sizeof v);
  v.bytes = r.bytes;
  v.checksum = r.checksum;
  v.tokens = r.tokens;
  WriteResult(v, out);
}

// The caller's config as this library's kvd_config: its first struct_size bytes, this library's
// defaults for fields the caller's header does not have. INVALID_ARGUMENT for a struct_size that
// kvd_config_init did not set, and for fields this library does not know set to nonzero values.
kvd::Status ReadConfig(const kvd_config& caller, kvd_config* out) {
  const size_t size = caller.struct_size;
  if (kvd::Status s = CheckStructSize("kvd_config", size, kFirstSizedConfigBytes); !s.ok()) {
    return s;
  }
  kvd_config_init_sized(out, sizeof *out);
  std::memcpy(out, &caller, std::min(size, sizeof *out));
  out->struct_size = sizeof *out;
  if (size > sizeof *out) {
    const auto* extra = reinterpret_cast<const unsigned char*>(&caller) + sizeof *out;
    if (std::any_of(extra, extra + (size - sizeof *out), [](unsigned char b) { return b != 0; })) {
      return kvd::Status::InvalidArgument(
          "kvd_config sets fields this libkvd_client does not know (struct_size " +
          std::to_string(size) + ", this library's " + std::to_string(sizeof *out) +
          "): use a libkvd_client as new as the kvd_client.h the program was built with, or "
          "leave those fields zero");
    }
  }
  return kvd::Status::Ok();
}

}  // namespace

extern "C" {

int kvd_client_abi_version(void) { return KVD_CLIENT_ABI_VERSION; }

const char* kvd_last_error(void) { return g_last_error.c_str(); }

const char* kvd_error_name(int code) {
  if (code < 0 || code > KVD_PERMISSION_DENIED) return "UNKNOWN";
  return kvd::StatusCodeName(static_cast<kvd::StatusCode>(code)).data();
}

void kvd_config_init_sized(kvd_config* config, size_t struct_size) {
  if (config == nullptr || struct_size < kFirstSizedConfigBytes) return;
  kvd_config c;
  std::memset(&c, 0, sizeof c);
  kvd::ModelLayout d;
  c.layout.tp_size = d.tp_size;
  c.layout.dtype = static_cast<int32_t>(d.dtype);
  c.layout.rope_theta = d.rope.theta;
  c.layout.rope_pairing = static_cast<int32_t>(d.rope.pairing);
  c.layout.rope_scaling = static_cast<int32_t>(d.rope.scaling);
  c.layout.rope_factor = d.rope.factor;
  c.layout.rope_low_freq_factor = d.rope.low_freq_factor;
  c.layout.rope_high_freq_factor = d.rope.high_freq_factor;
  c.layout.rope_original_max_positions = d.rope.original_max_positions;
  // Only the caller's bytes: a caller built against an older header has a smaller struct.
  const size_t known = std::min(struct_size, sizeof c);
  std::memcpy(config, &c, known);
  std::memset(reinterpret_cast<unsigned char*>(config) + known, 0, struct_size - known);
  config->struct_size = struct_size;
}

int kvd_client_connect(const kvd_config* caller, kvd_client** out) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(caller != nullptr && out != nullptr, "config and out must not be NULL");
    *out = nullptr;
    kvd_config config;
    if (kvd::Status s = ReadConfig(*caller, &config); !s.ok()) return Fail(s);
    const kvd_config* c = &config;
    kvd::client::ClientOptions o;
    if (c->address) o.address = c->address;
    if (c->client_id) o.client_id = c->client_id;
    if (c->name_space) o.name_space = c->name_space;
    if (c->model) o.model = c->model;
    o.role = c->admin ? kvd::client::Role::kAdmin : kvd::client::Role::kEngine;
    if (!c->admin) o.layout = ToLayout(c->layout);
    if (c->hash_seed) o.hash_seed = c->hash_seed;
    if (c->chunk_tokens) o.chunk_tokens = c->chunk_tokens;
    if (c->block_tokens) o.block_tokens = c->block_tokens;
    if (c->transport_backend) o.transport.backend = c->transport_backend;
    auto& ucx = kvd::transport::MutableBackendOptions<kvd::transport::UcxOptions>(&o.transport);
    if (c->ucx_tls) ucx.ucx_tls = c->ucx_tls;
    if (c->net_devices) ucx.net_devices = c->net_devices;
    if (c->connect_timeout_ms) o.connect_timeout_ms = c->connect_timeout_ms;
    if (c->request_timeout_ms) o.request_timeout_ms = c->request_timeout_ms;
    if (c->transfer_timeout_ms) o.transfer_timeout_ms = c->transfer_timeout_ms;
    if (c->max_in_flight) o.max_in_flight = c->max_in_flight;
    if (c->inline_put_bytes < 0) o.inline_put_bytes = 0;
    if (c->inline_put_bytes > 0) o.inline_put_bytes = static_cast<size_t>(c->inline_put_bytes);
    if (c->auth_token) o.auth_token = c->auth_token;
    if (c->shared_memory < 0) o.shared_memory = false;
    o.read_only = c->read_only != 0;
    if (c->lease_ttl_ms) o.lease_ttl_ms = c->lease_ttl_ms;
    if (c->reserve_ahead > 0) o.reserve_ahead = true;
    auto client = kvd::client::Client::Connect(o);
    if (!client.ok()) return Fail(client.status());
    *out = new kvd_client{std::move(client).value()};
    return KVD_OK;
  });
}

void kvd_client_close(kvd_client* client) {
  try {
    delete client;
  } catch (...) {
  }
}

int kvd_client_chunk_chain(kvd_client* client, const int32_t* tokens, size_t num_tokens,
                           int include_partial_chunk, kvd_hash128* out, size_t capacity,
                           size_t* count) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && count != nullptr, "client and count must not be NULL");
    KVD_C_REQUIRE(tokens != nullptr || num_tokens == 0, "tokens is NULL");
    auto chain = client->impl->hasher().ChunkChain({tokens, num_tokens}, include_partial_chunk);
    *count = chain.size();
    if (chain.size() > capacity) {
      return Fail(KVD_OUT_OF_RANGE, "OUT_OF_RANGE: " + std::to_string(chain.size()) +
                                        " chunk keys, capacity " + std::to_string(capacity));
    }
    for (size_t i = 0; i < chain.size(); ++i) out[i] = kvd_hash128{chain[i].hi, chain[i].lo};
    return KVD_OK;
  });
}

int kvd_client_lookup(kvd_client* client, const kvd_hash128* chain, size_t chain_length,
                      kvd_lookup_result* out) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && out != nullptr, "client and out must not be NULL");
    KVD_C_REQUIRE(chain != nullptr || chain_length == 0, "chain is NULL");
    if (kvd::Status s = CheckResult(*out); !s.ok()) return Fail(s);
    auto r = client->impl->Lookup(ToChain(chain, chain_length));
    if (!r.ok()) return Fail(r.status());
    WriteResult(*r, out);
    return KVD_OK;
  });
}

int kvd_client_lookup_cluster(kvd_client* client, const kvd_hash128* chain, size_t chain_length,
                              kvd_lookup_result* out, char** holders_json) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && out != nullptr, "client and out must not be NULL");
    KVD_C_REQUIRE(chain != nullptr || chain_length == 0, "chain is NULL");
    if (holders_json != nullptr) *holders_json = nullptr;
    if (kvd::Status s = CheckResult(*out); !s.ok()) return Fail(s);
    auto r = client->impl->Lookup(ToChain(chain, chain_length), {.cluster = true});
    if (!r.ok()) return Fail(r.status());
    if (holders_json != nullptr) {
      *holders_json = CopyString(kvd::client::HoldersToJson(r->holders));
      if (*holders_json == nullptr) {
        (void)client->impl->ReleaseLease(r->lease_id);  // the caller never learns of the lease
        return Fail(KVD_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: malloc failed");
      }
    }
    WriteResult(*r, out);
    return KVD_OK;
  });
}

int kvd_client_place(kvd_client* client, const kvd_hash128* chain, size_t chain_length,
                     const char* node, kvd_placement** out) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && out != nullptr, "client and out must not be NULL");
    KVD_C_REQUIRE(chain != nullptr || chain_length == 0, "chain is NULL");
    *out = nullptr;
    kvd::client::PlacementOptions o;
    if (node != nullptr) o.node = node;
    auto r = client->impl->Place(ToChain(chain, chain_length), o);
    if (!r.ok()) return Fail(r.status());
    *out = new kvd_placement{std::move(r).value()};
    return KVD_OK;
  });
}

size_t kvd_placement_count(const kvd_placement* placement) {
  return placement == nullptr ? 0 : placement->result.targets.size();
}

int kvd_placement_membership_current(const kvd_placement* placement) {
  return placement != nullptr && placement->result.membership_current ? 1 : 0;
}

uint64_t kvd_placement_membership_age_ms(const kvd_placement* placement) {
  return placement != nullptr ? placement->result.membership_age_ms : 0;
}

int kvd_placement_target(const kvd_placement* placement, size_t index, const char** node,
                         const char** control_address, int* local) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(placement != nullptr, "placement is NULL");
    const auto& targets = placement->result.targets;
    if (index >= targets.size()) {
      return Fail(KVD_OUT_OF_RANGE, "OUT_OF_RANGE: target " + std::to_string(index) + " of " +
                                        std::to_string(targets.size()));
    }
    if (node != nullptr) *node = targets[index].node.c_str();
    if (control_address != nullptr) *control_address = targets[index].control_address.c_str();
    if (local != nullptr) *local = targets[index].local ? 1 : 0;
    return KVD_OK;
  });
}

void kvd_placement_free(kvd_placement* placement) {
  Guard([&]() -> int {
    delete placement;
    return KVD_OK;
  });
}

int kvd_client_connect_placed(kvd_client* client, const kvd_placement* placement, size_t index,
                              kvd_client** out) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && placement != nullptr && out != nullptr,
                  "client, placement and out must not be NULL");
    *out = nullptr;
    const auto& targets = placement->result.targets;
    if (index >= targets.size()) {
      return Fail(KVD_OUT_OF_RANGE, "OUT_OF_RANGE: target " + std::to_string(index) + " of " +
                                        std::to_string(targets.size()));
    }
    auto placed = kvd::client::Client::Connect(
        kvd::client::PlacedOptions(client->impl->options(), targets[index]));
    if (!placed.ok()) return Fail(placed.status());
    *out = new kvd_client{std::move(placed).value()};
    return KVD_OK;
  });
}

int kvd_client_release_lease(kvd_client* client, uint64_t lease_id) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr, "client is NULL");
    kvd::Status s = client->impl->ReleaseLease(lease_id);
    return s.ok() ? KVD_OK : Fail(s);
  });
}

int kvd_client_flush_releases(kvd_client* client) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr, "client is NULL");
    kvd::Status s = client->impl->FlushReleases();
    return s.ok() ? KVD_OK : Fail(s);
  });
}

int kvd_client_put(kvd_client* client, kvd_hash128 hash, int32_t tokens, const void* data,
                   size_t bytes, int* already_stored) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr, "client is NULL");
    auto r = client->impl->Put(ToHash(hash), tokens, data, bytes);
    if (!r.ok()) return Fail(r.status());
    if (already_stored) *already_stored = r->already_stored ? 1 : 0;
    return KVD_OK;
  });
}

int kvd_client_put_layers(kvd_client* client, kvd_hash128 hash, int32_t tokens,
                          const void* const* k_layers, const void* const* v_layers,
                          int* already_stored) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && k_layers != nullptr && v_layers != nullptr,
                  "client, k_layers and v_layers must not be NULL");
    int n = client->impl->options().layout.num_layers;
    std::vector<kvd::client::LayerKV> layers(n);
    for (int l = 0; l < n; ++l) layers[l] = {k_layers[l], v_layers[l]};
    auto r = client->impl->PutLayers(ToHash(hash), tokens, layers);
    if (!r.ok()) return Fail(r.status());
    if (already_stored) *already_stored = r->already_stored ? 1 : 0;
    return KVD_OK;
  });
}

int kvd_client_get(kvd_client* client, uint64_t lease_id, uint32_t chunk_index, void* out,
                   size_t capacity, kvd_get_result* result) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr, "client is NULL");
    if (kvd::Status s = result ? CheckResult(*result) : kvd::Status::Ok(); !s.ok()) return Fail(s);
    auto r = client->impl->Get(lease_id, chunk_index, out, capacity);
    if (!r.ok()) return Fail(r.status());
    if (result) WriteResult(*r, result);
    return KVD_OK;
  });
}

int kvd_client_read_in_place(kvd_client* client, uint64_t lease_id, uint32_t chunk_index,
                             uint32_t flags, kvd_chunk_view** view, const void** data,
                             kvd_get_result* result) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && view != nullptr && data != nullptr,
                  "client, view and data must not be NULL");
    *view = nullptr;
    *data = nullptr;
    if (result != nullptr) {
      if (auto bad = CheckResult(*result); !bad.ok()) return Fail(bad);
    }
    kvd::client::ReadInPlaceOptions o;
    o.verify_checksum = (flags & KVD_READ_NO_VERIFY) == 0;
    o.pin_for_device = (flags & KVD_READ_PIN_FOR_DEVICE) != 0;
    auto r = client->impl->ReadInPlace(lease_id, chunk_index, o);
    if (!r.ok()) return Fail(r.status());
    auto out = std::make_unique<kvd_chunk_view>();
    out->view = std::move(r).value();
    if (result != nullptr) WriteResult(out->view.result(), result);
    *data = out->view.data();
    *view = out.release();
    return KVD_OK;
  });
}

void kvd_chunk_view_release(kvd_chunk_view* view) {
  Guard([&]() -> int {
    delete view;
    return KVD_OK;
  });
}

int kvd_client_reserve_put(kvd_client* client, kvd_hash128 hash, int32_t tokens, size_t bytes,
                           kvd_put_slot** slot, void** data, int* already_stored) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && slot != nullptr && data != nullptr,
                  "client, slot and data must not be NULL");
    *slot = nullptr;
    *data = nullptr;
    auto r = client->impl->ReservePut(ToHash(hash), tokens, bytes);
    if (!r.ok()) return Fail(r.status());
    auto out = std::make_unique<kvd_put_slot>();
    out->slot = std::move(r).value();
    if (already_stored) *already_stored = out->slot.already_stored() ? 1 : 0;
    *data = out->slot.data();
    *slot = out.release();
    return KVD_OK;
  });
}

int kvd_client_commit_put(kvd_client* client, kvd_put_slot* slot, uint64_t* stored_bytes) {
  std::unique_ptr<kvd_put_slot> owned(slot);
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && owned != nullptr, "client and slot must not be NULL");
    auto r = client->impl->CommitPut(std::move(owned->slot));
    if (!r.ok()) return Fail(r.status());
    if (stored_bytes) *stored_bytes = r->stored_bytes;
    return KVD_OK;
  });
}

void kvd_put_slot_abort(kvd_put_slot* slot) {
  Guard([&]() -> int {
    delete slot;
    return KVD_OK;
  });
}

int kvd_client_get_layers(kvd_client* client, uint64_t lease_id, uint32_t chunk_index,
                          void* const* k_layers, void* const* v_layers, int32_t capacity_tokens,
                          kvd_get_result* result) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && k_layers != nullptr && v_layers != nullptr,
                  "client, k_layers and v_layers must not be NULL");
    if (kvd::Status s = result ? CheckResult(*result) : kvd::Status::Ok(); !s.ok()) return Fail(s);
    int n = client->impl->options().layout.num_layers;
    std::vector<kvd::client::MutableLayerKV> layers(n);
    for (int l = 0; l < n; ++l) layers[l] = {k_layers[l], v_layers[l]};
    auto r = client->impl->GetLayers(lease_id, chunk_index, layers, capacity_tokens);
    if (!r.ok()) return Fail(r.status());
    if (result) WriteResult(*r, result);
    return KVD_OK;
  });
}

int kvd_client_stats_json(kvd_client* client, char** json) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && json != nullptr, "client and json must not be NULL");
    auto r = client->impl->GetStats();
    if (!r.ok()) return Fail(r.status());
    *json = CopyString(kvd::client::StatsToJson(*r));
    return *json ? KVD_OK : Fail(KVD_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: malloc failed");
  });
}

int kvd_client_session_json(kvd_client* client, char** json) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && json != nullptr, "client and json must not be NULL");
    *json = CopyString(kvd::client::SessionToJson(client->impl->session()));
    return *json ? KVD_OK : Fail(KVD_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: malloc failed");
  });
}

int kvd_client_health_json(kvd_client* client, char** json) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && json != nullptr, "client and json must not be NULL");
    auto r = client->impl->GetHealth();
    if (!r.ok()) return Fail(r.status());
    *json = CopyString(kvd::client::HealthToJson(*r));
    return *json ? KVD_OK : Fail(KVD_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: malloc failed");
  });
}

int kvd_client_subscribe_events(kvd_client* client, const char* name_space, uint32_t queue_limit) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr, "client must not be NULL");
    auto r = client->impl->SubscribeEvents({name_space ? name_space : "", queue_limit});
    return r.ok() ? KVD_OK : Fail(r.status());
  });
}

int kvd_client_poll_events_json(kvd_client* client, int64_t timeout_ms, char** json) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && json != nullptr, "client and json must not be NULL");
    auto r = client->impl->PollEvents(timeout_ms);
    if (!r.ok()) return Fail(r.status());
    std::string out = "[";
    for (size_t i = 0; i < r->size(); ++i) {
      out += (i ? "," : "") + kvd::client::EventToJson((*r)[i]);
    }
    *json = CopyString(out + "]");
    return *json ? KVD_OK : Fail(KVD_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED: malloc failed");
  });
}

int kvd_client_evict(kvd_client* client, const char* scope, const char* value,
                     uint64_t* evicted_chunks) {
  return Guard([&]() -> int {
    KVD_C_REQUIRE(client != nullptr && scope != nullptr, "client and scope must not be NULL");
    kvd::client::EvictFilter f;
    std::string s = scope;
    if (s == "all") {
      f.kind = kvd::client::EvictFilter::Kind::kAll;
    } else if (s == "namespace" || s == "model" || s == "chunk") {
      KVD_C_REQUIRE(value != nullptr, "evict scope '" + s + "' needs a value");
      f.name = value;
      if (s == "namespace") f.kind = kvd::client::EvictFilter::Kind::kNamespace;
      if (s == "model") f.kind = kvd::client::EvictFilter::Kind::kModel;
      if (s == "chunk") {
        f.kind = kvd::client::EvictFilter::Kind::kChunk;
        KVD_C_REQUIRE(kvd::Hash128::FromHex(value, &f.chunk),
                      "chunk must be 32 hex digits, got '" + std::string(value) + "'");
      }
    } else {
      return Fail(
          KVD_INVALID_ARGUMENT,
          "INVALID_ARGUMENT: evict scope must be all, namespace, model or chunk; got '" + s + "'");
    }
    auto r = client->impl->Evict(f);
    if (!r.ok()) return Fail(r.status());
    if (evicted_chunks) *evicted_chunks = r->chunks;
    return KVD_OK;
  });
}

void kvd_free_string(char* s) { std::free(s); }

}  // extern "C"
