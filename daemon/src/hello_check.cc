// The checks of a Hello.
#include "hello_check.h"

#include <unistd.h>

#include "kvd/common/hash.h"
#include "kvd/common/hex.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"

namespace kvd::daemon {

namespace {

std::string Hex(uint64_t v) { return "0x" + Hex64(v); }

// The engine role's checks: model, layout, hash seed, chunk size, codec, transport.
Status CheckEngine(const HelloTerms& terms, const HelloFields& hello, const HelloPeer& peer,
                   Grant* grant) {
  const DaemonConfig& config = *terms.config;
  const std::string& model_name = hello.model;
  const ModelConfig* model = config.FindModel(model_name);
  if (model == nullptr) {
    std::string names;
    for (const auto& m : config.models) names += (names.empty() ? "" : ", ") + m.name;
    return Status::NotFound("unknown model \"" + model_name + "\": this daemon serves " + names);
  }
  if (!hello.layout.ok()) return hello.layout.status().WithContext("layout of model " + model_name);
  if (!(*hello.layout == model->layout)) {
    return Status::FailedPrecondition("layout mismatch for model " + model_name + ": " +
                                      model->layout.DescribeMismatch(*hello.layout));
  }
  const uint64_t daemon_digest = Digest64(config.hash_seed);
  if (hello.hash_seed_digest != daemon_digest) {
    return Status::FailedPrecondition(
        "hash seed mismatch: client digest " + Hex(hello.hash_seed_digest) + ", daemon digest " +
        Hex(daemon_digest) + "; every client and daemon of a deployment must use the same seed");
  }
  if (hello.chunk_tokens != static_cast<uint32_t>(config.chunk_tokens)) {
    return Status::FailedPrecondition(
        "chunk size mismatch: client uses " + std::to_string(hello.chunk_tokens) +
        " tokens per chunk, daemon uses " + std::to_string(config.chunk_tokens));
  }
  const uint32_t codec = hello.codec_id;
  ChunkCodec* model_codec = terms.codec ? terms.codec(model->name) : nullptr;
  if (codec != storage::kRawCodecId && model_codec == nullptr) {
    return Status::FailedPrecondition("codec " + std::to_string(codec) + " asked, but model " +
                                      model_name +
                                      " has no compression policy: its chunks are raw (codec 0)");
  }
  if (codec != storage::kRawCodecId && codec != model_codec->codec_id()) {
    return Status::FailedPrecondition(
        "codec " + std::to_string(codec) + " asked, but model " + model_name +
        "'s compression policy (" + model_codec->policy().StagesName() + ") is codec " +
        std::to_string(model_codec->codec_id()) + " now; send codec 0 to follow the policy");
  }
  if (hello.worker_address.empty()) {
    return Status::InvalidArgument(
        "engine role needs workerAddress (the client's transport address)");
  }
  // The shared-memory path needs a client on this host: a unix-socket connection.
  const bool shm = hello.shared_memory && peer.on_unix && terms.shared_memory_arena;
  if (!shm && config.transport.backend == "none") {
    return Status::FailedPrecondition(
        "this kvd runs without a bulk transport (transport.backend: none) and serves engines "
        "only on its shared-memory path: connect over its unix socket with shared memory on" +
        std::string(peer.on_unix ? " (this client asked for no shared memory)" : ""));
  }
  grant->engine = true;
  grant->model = model;
  grant->codec = model_codec;
  grant->layout_digest = model->layout.Digest();
  grant->worker_address = hello.worker_address;
  grant->shared_memory = shm;
  return Status::Ok();
}

}  // namespace

HelloFields ReadHello(proto::Hello::Reader hello) {
  HelloFields f;
  f.protocol_version = hello.getProtocolVersion();
  f.client_id = hello.getClientId();
  f.role = hello.getRole();
  f.name_space = hello.getNamespace();
  f.model = hello.getModel();
  f.hash_seed_digest = hello.getHashSeedDigest();
  f.chunk_tokens = hello.getChunkTokens();
  auto address = hello.getWorkerAddress();
  f.worker_address.assign(reinterpret_cast<const char*>(address.begin()), address.size());
  f.codec_id = hello.getCodecId();
  f.shared_memory = hello.getSharedMemory();
  f.read_only = hello.getReadOnly();
  f.keep_idle = hello.getKeepIdle();
  f.auth_token = hello.getAuthToken();
  f.cluster_token = hello.getClusterToken();
  if (f.role == proto::Role::ENGINE) f.layout = proto::FromProto(hello.getLayout());
  return f;
}

StatusOr<Grant> CheckHello(const HelloTerms& terms, const HelloFields& hello,
                           const HelloPeer& peer) {
  if (hello.protocol_version != proto::PROTOCOL_VERSION) {
    return Status::FailedPrecondition("protocol version mismatch: client speaks " +
                                      std::to_string(hello.protocol_version) + ", daemon speaks " +
                                      std::to_string(proto::PROTOCOL_VERSION));
  }
  const auto role = hello.role;
  if (role != proto::Role::ENGINE && role != proto::Role::ADMIN) {
    return Status::InvalidArgument("unknown role " + std::to_string(static_cast<int>(role)));
  }
  // Names a session keeps are echoed later (stats, lists, events, logs): text only.
  if (proto::ValidUtf8(hello.name_space) != hello.name_space) {
    return Status::InvalidArgument("Hello.namespace \"" + hello.name_space +
                                   "\" is not valid UTF-8");
  }
  if (proto::ValidUtf8(hello.client_id) != hello.client_id) {
    return Status::InvalidArgument("Hello.clientId \"" + hello.client_id +
                                   "\" is not valid UTF-8");
  }
  Grant grant;
  grant.client_id = hello.client_id;
  grant.name_space = hello.name_space.empty() ? "default" : hello.name_space;
  grant.read_only = hello.read_only;
  grant.keep_idle = hello.keep_idle;
  if (!hello.cluster_token.empty()) {
    KVD_RETURN_IF_ERROR(AuthenticatePeer(*terms.config, hello.cluster_token));
    grant.read_only = true;
  } else {
    KVD_RETURN_IF_ERROR(Authenticate(*terms.auth, peer.info, role == proto::Role::ENGINE,
                                     grant.name_space, hello.auth_token));
  }
  if (role == proto::Role::ENGINE) KVD_RETURN_IF_ERROR(CheckEngine(terms, hello, peer, &grant));
  return grant;
}

Status AuthenticatePeer(const DaemonConfig& config, const std::string& cluster_token) {
  if (!config.cluster) {
    return Status::PermissionDenied(
        "cluster token given, but this kvd is in no cluster (no cluster section): no peer "
        "sessions");
  }
  if (config.cluster->token.empty() || !TokenEquals(config.cluster->token, cluster_token)) {
    return Status::PermissionDenied("cluster token mismatch: the peer's cluster.token is not "
                                    "this node's (cluster " +
                                    config.cluster->name + ")");
  }
  return Status::Ok();
}

Status Authenticate(const AuthTokens& auth, const PeerInfo& peer, bool engine,
                    const std::string& name_space, const std::string& token) {
  if (engine) {
    if (!auth.enabled) return Status::Ok();
    auto it = auth.namespaces.find(name_space);
    if (it == auth.namespaces.end()) {
      return Status::PermissionDenied("namespace \"" + name_space +
                                      "\" has no token in auth.tokens_file: not served");
    }
    if (!TokenEquals(it->second, token)) {
      return Status::PermissionDenied(std::string(token.empty() ? "no" : "wrong") +
                                      " token for namespace \"" + name_space + "\"");
    }
    return Status::Ok();
  }
  // Admin: the unix socket's peer credentials, else the admin token.
  if (peer.unix_socket) {
    if (peer.uid == 0 || peer.uid == static_cast<int64_t>(::geteuid())) return Status::Ok();
    if (!auth.admin.empty() && TokenEquals(auth.admin, token)) return Status::Ok();
    return Status::PermissionDenied(
        "admin role over the unix socket needs the daemon's user (uid " +
        std::to_string(::geteuid()) + ") or root; peer uid " + std::to_string(peer.uid));
  }
  if (!auth.enabled) return Status::Ok();  // only loopback, or allow_unauthenticated
  if (auth.admin.empty()) {
    return Status::PermissionDenied(
        "admin role over TCP needs the admin token, and auth.tokens_file has no admin line; use "
        "the unix socket");
  }
  if (!TokenEquals(auth.admin, token)) {
    return Status::PermissionDenied(std::string(token.empty() ? "no" : "wrong") + " admin token");
  }
  return Status::Ok();
}

}  // namespace kvd::daemon
