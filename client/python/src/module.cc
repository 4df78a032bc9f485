// kvd._kvd: the Python binding of libkvd_client (the `kvd` package wraps it; see
// client/python/kvd/__init__.py for the user-facing documentation).
//
// Every blocking call releases the GIL. Buffers are borrowed without copies (buffers.h) for
// the duration of the call. A failed call raises kvd.Error (or its subclass for the status
// code) carrying .code (int, kvd::StatusCode), .code_name ("NOT_FOUND") and .message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding.h"
#include "buffers.h"
#include "kvd/client/client.h"
#include "kvd/client/expand.h"
#include "kvd/client/json.h"

namespace py = pybind11;
using kvd::Hash128;
using kvd::Status;
using kvd::StatusOr;
using kvd::client::Client;
using kvd::client::ClientOptions;
using kvd::python::BufferView;
using kvd::python::Check;
using kvd::python::Connect;
using kvd::python::PyClient;
using kvd::python::Raise;

namespace kvd::python {

void SetError(const Status& s) {
  try {
    py::object error_for_code = py::module_::import("kvd._errors").attr("error_for_code");
    py::object cls = error_for_code(static_cast<int>(s.code()));
    py::object exc =
        cls(static_cast<int>(s.code()), std::string(kvd::StatusCodeName(s.code())), s.message());
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (py::error_already_set& e) {
    e.restore();  // kvd._errors could not be imported: that error is the one in flight
  }
}

void Raise(const Status& s) {
  SetError(s);
  throw py::error_already_set();
}

std::unique_ptr<client::Client> Connect(const client::ClientOptions& o) {
  std::unique_ptr<Client> client;
  Status status;
  {
    py::gil_scoped_release nogil;
    auto c = client::Client::Connect(o);
    if (c.ok()) {
      client = std::move(c).value();
    } else {
      status = c.status();
    }
  }
  Check(status);
  return client;
}

}  // namespace kvd::python

namespace {

BufferView View(py::handle obj, bool writable, const char* what) {
  return Check(BufferView::Of(obj, writable, what));
}

// Tokens from a buffer of int32 (numpy int32 array) or any sequence of ints.
std::vector<int32_t> Tokens(py::handle obj) {
  if (PyObject_CheckBuffer(obj.ptr())) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
    if (info.itemsize == 4 &&
        (info.format == "i" || info.format == "l" || info.format == "=i" || info.format == "<i") &&
        info.ndim == 1) {
      const auto* p = static_cast<const int32_t*>(info.ptr);
      if (info.strides[0] == 4) return std::vector<int32_t>(p, p + info.shape[0]);
    }
  }
  std::vector<int32_t> out;
  for (py::handle t : py::iter(obj)) out.push_back(py::cast<int32_t>(t));
  return out;
}

kvd::ModelLayout LayoutFromDict(const py::dict& d) {
  kvd::ModelLayout l;
  auto get_int = [&](const char* k, int fallback) {
    return d.contains(k) ? py::cast<int>(d[k]) : fallback;
  };
  l.num_layers = get_int("num_layers", 0);
  l.num_kv_heads = get_int("num_kv_heads", 0);
  l.num_q_heads = get_int("num_q_heads", 0);
  l.head_dim = get_int("head_dim", 0);
  l.tp_rank = get_int("tp_rank", 0);
  l.tp_size = get_int("tp_size", 1);
  if (d.contains("dtype")) {
    l.dtype = Check(kvd::ParseDType(py::cast<std::string>(d["dtype"])));
  }
  if (d.contains("rope_theta")) l.rope.theta = py::cast<double>(d["rope_theta"]);
  l.rope.rotary_dim = get_int("rope_rotary_dim", 0);
  if (d.contains("rope_pairing")) {
    std::string p = py::cast<std::string>(d["rope_pairing"]);
    if (p == "interleaved") {
      l.rope.pairing = kvd::RopePairing::kInterleaved;
    } else if (p == "halves") {
      l.rope.pairing = kvd::RopePairing::kHalves;
    } else {
      Raise(Status::InvalidArgument("layout.rope_pairing: \"" + p +
                                    "\" is not interleaved or halves"));
    }
  }
  return l;
}

py::dict LayoutToDict(const kvd::ModelLayout& l) {
  py::dict d;
  d["num_layers"] = l.num_layers;
  d["num_kv_heads"] = l.num_kv_heads;
  d["num_q_heads"] = l.num_q_heads;
  d["head_dim"] = l.head_dim;
  d["dtype"] = std::string(kvd::DTypeName(l.dtype));
  d["tp_rank"] = l.tp_rank;
  d["tp_size"] = l.tp_size;
  d["rope_theta"] = l.rope.theta;
  d["rope_rotary_dim"] = l.rope.rotary_dim;
  d["rope_pairing"] = l.rope.pairing == kvd::RopePairing::kInterleaved ? "interleaved" : "halves";
  return d;
}

py::object JsonLoads(const std::string& s) { return py::module_::import("json").attr("loads")(s); }

// Layout of `model` as the daemon registered it (admin connection).
kvd::ModelLayout RegisteredLayout(const ClientOptions& engine, const std::string& model) {
  ClientOptions admin;
  admin.address = engine.address;
  admin.role = kvd::client::Role::kAdmin;
  admin.client_id = engine.client_id;
  admin.connect_timeout_ms = engine.connect_timeout_ms;
  admin.request_timeout_ms = engine.request_timeout_ms;
  auto a = Connect(admin);
  StatusOr<kvd::client::Stats> stats = Status::Internal("no stats");
  {
    py::gil_scoped_release nogil;
    stats = a->GetStats();
  }
  for (const auto& m : Check(std::move(stats)).registered_models) {
    if (m.name == model) return m.layout;
  }
  Raise(Status::NotFound("model \"" + model + "\" is not registered in the daemon at " +
                         engine.address));
}

// kvd._kvd.Hash128: a chunk's key.
void BindHash128(py::module_& m) {
  py::class_<Hash128>(m, "Hash128")
      .def(py::init([](uint64_t hi, uint64_t lo) {
             return Hash128{hi, lo};
           }),
           py::arg("hi"), py::arg("lo"))
      .def_static("from_hex",
                  [](const std::string& hex) {
                    Hash128 h;
                    if (!Hash128::FromHex(hex, &h)) {
                      Raise(Status::InvalidArgument("\"" + hex + "\" is not 32 hex digits"));
                    }
                    return h;
                  })
      .def_readonly("hi", &Hash128::hi)
      .def_readonly("lo", &Hash128::lo)
      .def("hex", &Hash128::ToHex)
      .def("__repr__", [](const Hash128& h) { return "Hash128('" + h.ToHex() + "')"; })
      .def("__eq__", [](const Hash128& a, const Hash128& b) { return a == b; })
      .def("__hash__", [](const Hash128& h) { return kvd::Hash128Hasher()(h); });
}

// The results of Client calls: LookupResult, PutResult, GetResult (read-only attributes).
void BindResults(py::module_& m) {
  py::class_<kvd::client::LookupResult>(m, "LookupResult")
      .def_readonly("matched_chunks", &kvd::client::LookupResult::matched_chunks)
      .def_readonly("matched_tokens", &kvd::client::LookupResult::matched_tokens)
      .def_readonly("lease_id", &kvd::client::LookupResult::lease_id)
      .def_readonly("lease_ttl_ms", &kvd::client::LookupResult::lease_ttl_ms)
      .def("__repr__", [](const kvd::client::LookupResult& r) {
        return "LookupResult(matched_chunks=" + std::to_string(r.matched_chunks) +
               ", matched_tokens=" + std::to_string(r.matched_tokens) +
               ", lease_id=" + std::to_string(r.lease_id) + ")";
      });
  py::class_<kvd::client::PutResult>(m, "PutResult")
      .def_readonly("bytes", &kvd::client::PutResult::bytes)
      .def_readonly("already_stored", &kvd::client::PutResult::already_stored);
  py::class_<kvd::client::GetResult>(m, "GetResult")
      .def_readonly("bytes", &kvd::client::GetResult::bytes)
      .def_readonly("checksum", &kvd::client::GetResult::checksum)
      .def_readonly("tokens", &kvd::client::GetResult::tokens)
      .def_readonly("codec_id", &kvd::client::GetResult::codec_id);
}

// Client.connect: the keyword arguments (their defaults in BindConnect) into ClientOptions, then
// a connection; an engine connection without a layout asks the daemon for the model's.
PyClient ConnectClient(const std::string& address, const std::string& model,
                       std::optional<py::dict> layout, const std::string& name_space,
                       const std::string& client_id, const std::string& hash_seed, int chunk_tokens,
                       int block_tokens, const std::string& ucx_tls, const std::string& net_devices,
                       bool admin, int64_t timeout_ms, int max_in_flight, bool nccl,
                       int nccl_device, int64_t inline_put_bytes, bool read_only,
                       bool shared_memory, bool reserve_ahead) {
  ClientOptions o;
  o.address = address;
  o.client_id = client_id;
  o.name_space = name_space;
  o.hash_seed = hash_seed;
  o.chunk_tokens = chunk_tokens;
  o.block_tokens = block_tokens;
  auto& ucx = kvd::transport::MutableBackendOptions<kvd::transport::UcxOptions>(&o.transport);
  ucx.ucx_tls = ucx_tls;
  ucx.net_devices = net_devices;
  o.max_in_flight = max_in_flight;
  o.nccl = nccl;  // CUDA tensors move GPU to GPU over kvd's NCCL link
  kvd::transport::MutableBackendOptions<kvd::transport::NcclOptions>(&o.transport).nccl_device =
      nccl_device;
  if (inline_put_bytes < 0) {
    Raise(Status::InvalidArgument("inline_put_bytes must be >= 0 (0 = off), got " +
                                  std::to_string(inline_put_bytes)));
  }
  o.inline_put_bytes = static_cast<size_t>(inline_put_bytes);
  o.read_only = read_only;          // a reading session: puts refused, read-only mappings
  o.shared_memory = shared_memory;  // asked for on a unix-socket address
  o.reserve_ahead = reserve_ahead;  // a put's commit reserves the next put's slot
  if (timeout_ms > 0) {
    o.connect_timeout_ms = o.request_timeout_ms = o.transfer_timeout_ms = timeout_ms;
  }
  if (admin) {
    o.role = kvd::client::Role::kAdmin;
  } else {
    if (model.empty()) {
      Raise(
          Status::InvalidArgument("model: an engine connection needs a model name "
                                  "(or admin=True)"));
    }
    o.model = model;
    o.layout = layout ? LayoutFromDict(*layout) : RegisteredLayout(o, model);
  }
  return PyClient{Connect(o)};
}

// Client.connect, a static method.
void BindConnect(py::class_<PyClient>& client) {
  client.def_static(
      "connect", &ConnectClient, py::arg("address") = "127.0.0.1:7400", py::arg("model") = "",
      py::arg("layout") = py::none(), py::arg("namespace") = "", py::arg("client_id") = "",
      py::arg("hash_seed") = "kvd-default-seed", py::arg("chunk_tokens") = 256,
      py::arg("block_tokens") = 16, py::arg("ucx_tls") = "", py::arg("net_devices") = "",
      py::arg("admin") = false, py::arg("timeout_ms") = 0, py::arg("max_in_flight") = 8,
      py::arg("nccl") = false, py::arg("nccl_device") = 0,
      py::arg("inline_put_bytes") = kvd::client::ClientOptions().inline_put_bytes,
      py::arg("read_only") = false,
      py::arg("shared_memory") = kvd::client::ClientOptions().shared_memory,
      py::arg("reserve_ahead") = kvd::client::ClientOptions().reserve_ahead);
}

// The Client's read-only properties: its layout and chunk size, and what the session granted.
void BindClientProperties(py::class_<PyClient>& client) {
  client
      .def_property_readonly("layout",
                             [](PyClient& self) {
                               Client& c = self.get();
                               return LayoutToDict(c.options().layout);
                             })
      .def_property_readonly("chunk_bytes",
                             [](PyClient& self) {
                               Client& c = self.get();
                               return c.options().layout.ChunkBytes(c.options().chunk_tokens);
                             })
      .def_property_readonly("chunk_tokens",
                             [](PyClient& self) {
                               Client& c = self.get();
                               return c.options().chunk_tokens;
                             })
      .def_property_readonly("node_name",
                             [](PyClient& self) {
                               Client& c = self.get();
                               return c.session().node_name;
                             })
      .def_property_readonly("shared_memory",
                             [](PyClient& self) {
                               Client& c = self.get();
                               return c.session().shared_memory;
                             })
      .def_property_readonly("codec_id",
                             [](PyClient& self) { return self.get().session().codec_id; })
      .def_property_readonly("policy", [](PyClient& self) { return self.get().session().policy; })
      .def_property_readonly("needs_queries",
                             [](PyClient& self) { return self.get().session().needs_queries; })
      .def_property_readonly("keeps_positions",
                             [](PyClient& self) { return self.get().session().keeps_positions; })
      .def_property_readonly(
          "connected", [](PyClient& self) { return self.client && self.client->connected(); });
}

// Client.hash and Client.chunk_tokens_of: the chunk keys of a token sequence (no daemon call).
void BindHashing(py::class_<PyClient>& client) {
  client
      .def(
          "hash",
          [](PyClient& self, py::handle tokens, bool include_partial_chunk,
             const std::string& extra) {
            Client& c = self.get();
            std::vector<int32_t> t = Tokens(tokens);
            return c.hasher().ChunkChain(t, include_partial_chunk, extra);
          },
          py::arg("tokens"), py::arg("include_partial_chunk") = true, py::arg("extra") = "")
      .def(
          "chunk_tokens_of",
          [](PyClient& self, int64_t total_tokens, int64_t index) {
            Client& c = self.get();
            return c.hasher().ChunkTokens(total_tokens, index);
          },
          py::arg("total_tokens"), py::arg("index"));
}

// Client.lookup and Client.release: a lease on the longest stored prefix of a chain (cluster=True:
// at cluster scope, LookupOptions::cluster), and its end.
void BindLeases(py::class_<PyClient>& client) {
  client
      .def(
          "lookup",
          [](PyClient& self, const std::vector<Hash128>& chain, bool cluster) {
            Client& c = self.get();
            StatusOr<kvd::client::LookupResult> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.Lookup(chain, {.cluster = cluster});
            }
            return Check(std::move(r));
          },
          py::arg("chain"), py::kw_only(), py::arg("cluster") = false)
      .def(
          "release",
          [](PyClient& self, uint64_t lease_id) {
            Client& c = self.get();
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.ReleaseLease(lease_id);
            }
            Check(s);
          },
          py::arg("lease_id"));
}

// Views of the per-layer buffers `k` and `v` (as many of each; else INVALID_ARGUMENT naming
// `call`), their pointers set in `layers` (one per layer); `size_error(what, bytes)` is the
// message for a buffer of the wrong size, empty when it fits.
template <typename LayerKV>
std::vector<BufferView> LayerViews(
    const char* call, py::sequence k, py::sequence v, bool writable, std::vector<LayerKV>* layers,
    const std::function<std::string(const std::string& what, size_t bytes)>& size_error) {
  std::vector<BufferView> views;
  layers->resize(py::len(k));
  if (py::len(k) != py::len(v)) {
    Raise(Status::InvalidArgument(std::string(call) + ": " + std::to_string(py::len(k)) +
                                  " K layers but " + std::to_string(py::len(v)) + " V layers"));
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      std::string what = std::string(kv ? "v[" : "k[") + std::to_string(i) + "]";
      views.push_back(View(kv ? v[i] : k[i], writable, what.c_str()));
      if (std::string why = size_error(what, views.back().size()); !why.empty()) {
        Raise(Status::InvalidArgument(why));
      }
      (kv ? (*layers)[i].v : (*layers)[i].k) = views.back().data();
    }
  }
  return views;
}

// Client.put_layers: one chunk from per-layer K and V buffers of `tokens` tokens each.
kvd::client::PutResult PutLayers(PyClient& self, const Hash128& hash, int tokens, py::sequence k,
                                 py::sequence v) {
  Client& c = self.get();
  const size_t want = static_cast<size_t>(tokens) * c.options().layout.TokenBytes();
  std::vector<kvd::client::LayerKV> layers;
  std::vector<BufferView> views =
      LayerViews("put_layers", k, v, /*writable=*/false, &layers,
                 [&](const std::string& what, size_t bytes) -> std::string {
                   if (bytes == want) return "";
                   return what + ": " + std::to_string(bytes) + " bytes, the layout needs " +
                          std::to_string(want) + " for " + std::to_string(tokens) + " tokens";
                 });
  StatusOr<kvd::client::PutResult> r = Status::Internal("");
  {
    py::gil_scoped_release nogil;
    r = c.PutLayers(hash, tokens, layers);
  }
  return Check(std::move(r));
}

// Client.get_layers: one chunk into per-layer K and V buffers with room for `capacity_tokens`.
kvd::client::GetResult GetLayers(PyClient& self, uint64_t lease_id, uint32_t chunk_index,
                                 py::sequence k, py::sequence v, int capacity_tokens) {
  Client& c = self.get();
  const size_t want = static_cast<size_t>(capacity_tokens) * c.options().layout.TokenBytes();
  std::vector<kvd::client::MutableLayerKV> layers;
  std::vector<BufferView> views =
      LayerViews("get_layers", k, v, /*writable=*/true, &layers,
                 [&](const std::string& what, size_t bytes) -> std::string {
                   if (bytes >= want) return "";
                   return what + ": " + std::to_string(bytes) + " bytes, " +
                          std::to_string(capacity_tokens) + " tokens need " + std::to_string(want);
                 });
  StatusOr<kvd::client::GetResult> r = Status::Internal("");
  {
    py::gil_scoped_release nogil;
    r = c.GetLayers(lease_id, chunk_index, layers, capacity_tokens);
  }
  return Check(std::move(r));
}

// Client.put, put_layers, get, get_dense and get_layers: the chunks' bytes in and out.
void BindPutGet(py::class_<PyClient>& client) {
  client
      .def(
          "put",
          [](PyClient& self, const Hash128& hash, int tokens, py::handle data) {
            Client& c = self.get();
            BufferView v = View(data, /*writable=*/false, "data");
            StatusOr<kvd::client::PutResult> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.Put(hash, tokens, v.data(), v.size());
            }
            return Check(std::move(r));
          },
          py::arg("hash"), py::arg("tokens"), py::arg("data"))
      .def("put_layers", &PutLayers, py::arg("hash"), py::arg("tokens"), py::arg("k"), py::arg("v"))
      .def(
          "get",
          [](PyClient& self, uint64_t lease_id, uint32_t chunk_index, py::handle out) {
            Client& c = self.get();
            BufferView v = View(out, /*writable=*/true, "out");
            StatusOr<kvd::client::GetResult> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.Get(lease_id, chunk_index, v.data(), v.size());
            }
            return Check(std::move(r));
          },
          py::arg("lease_id"), py::arg("chunk_index"), py::arg("out"))
      .def(
          "get_dense",
          [](PyClient& self, uint64_t lease_id, uint32_t chunk_index, py::handle out) {
            Client& c = self.get();
            BufferView v = View(out, /*writable=*/true, "out");
            StatusOr<kvd::client::GetResult> r = Status::Internal("");
            int64_t tokens = 0;
            {
              py::gil_scoped_release nogil;
              r = kvd::client::GetDense(c, lease_id, chunk_index, v.data(), v.size(), &tokens);
            }
            kvd::client::GetResult got = Check(std::move(r));
            return py::make_tuple(got, tokens);
          },
          py::arg("lease_id"), py::arg("chunk_index"), py::arg("out"))
      .def("get_layers", &GetLayers, py::arg("lease_id"), py::arg("chunk_index"), py::arg("k"),
           py::arg("v"), py::arg("capacity_tokens"));
}

// Client.stats, health, subscribe_events, poll_events and close: the daemon's state and events.
void BindDaemonCalls(py::class_<PyClient>& client) {
  client
      .def("stats",
           [](PyClient& self) {
             Client& c = self.get();
             StatusOr<kvd::client::Stats> r = Status::Internal("");
             {
               py::gil_scoped_release nogil;
               r = c.GetStats();
             }
             return JsonLoads(kvd::client::StatsToJson(Check(std::move(r)), -1));
           })
      .def("health",
           [](PyClient& self) {
             Client& c = self.get();
             StatusOr<kvd::client::Health> r = Status::Internal("");
             {
               py::gil_scoped_release nogil;
               r = c.GetHealth();
             }
             return JsonLoads(kvd::client::HealthToJson(Check(std::move(r)), -1));
           })
      .def(
          "subscribe_events",
          [](PyClient& self, const std::string& name_space, uint32_t queue_limit) {
            Client& c = self.get();
            StatusOr<kvd::client::SubscriptionInfo> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.SubscribeEvents({name_space, queue_limit});
            }
            kvd::client::SubscriptionInfo info = Check(std::move(r));
            py::dict out;
            out["queue_limit"] = info.queue_limit;
            out["namespace"] = info.name_space;
            return out;
          },
          py::arg("namespace") = "", py::arg("queue_limit") = 0)
      .def(
          "poll_events",
          [](PyClient& self, int64_t timeout_ms) {
            Client& c = self.get();
            StatusOr<std::vector<kvd::client::KvEvent>> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.PollEvents(timeout_ms);
            }
            py::list out;
            for (const auto& e : Check(std::move(r))) {
              out.append(JsonLoads(kvd::client::EventToJson(e, -1)));
            }
            return out;
          },
          py::arg("timeout_ms") = 1000)
      .def("close", [](PyClient& self) {
        std::unique_ptr<Client> c = std::move(self.client);
        py::gil_scoped_release nogil;
        c.reset();  // says goodbye; bounded by the timeouts
      });
}

}  // namespace

PYBIND11_MODULE(_kvd, m) {
  m.doc() = "Binding of libkvd_client (use the kvd package)";
  // kvd's version (project(kvd VERSION ...) in kvd's CMakeLists.txt; client/python/CMakeLists.txt).
  m.attr("__version__") = KVD_PACKAGE_VERSION;
  BindHash128(m);
  BindResults(m);
  py::class_<PyClient> client(m, "Client");
  BindConnect(client);
  BindClientProperties(client);
  BindHashing(client);
  BindLeases(client);
  BindPutGet(client);
  BindDaemonCalls(client);
  kvd::python::BindInPlace(m, client);
  kvd::python::BindCluster(m, client);
}
