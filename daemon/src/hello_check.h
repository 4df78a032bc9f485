// The checks of a Hello, apart from the connection that sent it. Private to daemon/.
//
// CheckHello decides whether a Hello is served and with what (the Grant); the session applies
// a Grant and answers. Pure: no socket, no state of the daemon but what HelloTerms names.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "auth.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/daemon/chunk_codec.h"
#include "kvd/daemon/config.h"
#include "kvd/proto/kvd.capnp.h"

namespace kvd::daemon {

// A Hello's fields, read out of the message (ReadHello).
struct HelloFields {
  uint32_t protocol_version = 0;
  std::string client_id;
  proto::Role role = proto::Role::ENGINE;
  std::string name_space;  // "" = "default"
  std::string model;
  uint64_t hash_seed_digest = 0;
  uint32_t chunk_tokens = 0;
  std::string worker_address;  // the client's transport address
  uint32_t codec_id = 0;
  bool shared_memory = false;
  bool read_only = false;
  bool keep_idle = false;
  std::string auth_token;
  std::string cluster_token;  // a peer kvd of this cluster (Hello.clusterToken); "" = none
  StatusOr<ModelLayout> layout = Status::InvalidArgument("no layout");  // engine role only
};

// Reads every field (a hostile message throws here, before any state changes: call it inside
// proto::TryDecode).
HelloFields ReadHello(proto::Hello::Reader hello);

// What the daemon serves.
struct HelloTerms {
  const DaemonConfig* config = nullptr;
  const AuthTokens* auth = nullptr;
  // The codec of a model with a compression policy; nullptr for a raw model.
  std::function<ChunkCodec*(const std::string& model)> codec;
  bool shared_memory_arena = false;  // the daemon has a ShmArena
};

// Where the Hello came from.
struct HelloPeer {
  PeerInfo info;
  bool on_unix = false;  // the connection is on the unix socket (the shared-memory path needs it)
};

// What a served Hello gets.
struct Grant {
  bool engine = false;
  std::string client_id;
  std::string name_space = "default";
  bool read_only = false;
  bool keep_idle = false;
  // Engine role only:
  const ModelConfig* model = nullptr;
  ChunkCodec* codec = nullptr;  // the model's codec when it has a compression policy
  uint64_t layout_digest = 0;
  std::string worker_address;
  bool shared_memory = false;
};

// The Grant of `hello`, or why it is refused: FAILED_PRECONDITION (protocol version, layout,
// hash seed, chunk size or codec mismatch; no bulk transport without shared memory),
// INVALID_ARGUMENT (unknown role, text not UTF-8, no worker address, a bad layout),
// PERMISSION_DENIED (Authenticate, or a cluster token this daemon does not share: see
// AuthenticatePeer), NOT_FOUND (unknown model).
StatusOr<Grant> CheckHello(const HelloTerms& terms, const HelloFields& hello,
                           const HelloPeer& peer);

// The handshake's token / peer check for the engine role in `name_space`, or the admin role
// (see AuthOptions): PERMISSION_DENIED with the reason.
Status Authenticate(const AuthTokens& auth, const PeerInfo& peer, bool engine,
                    const std::string& name_space, const std::string& token);

// A Hello with a cluster token (a peer kvd fetching chunks): OK when this daemon is in a cluster
// whose cluster.token equals it; PERMISSION_DENIED naming why otherwise. A peer's session needs
// no namespace token and is read-only.
Status AuthenticatePeer(const DaemonConfig& config, const std::string& cluster_token);

}  // namespace kvd::daemon
