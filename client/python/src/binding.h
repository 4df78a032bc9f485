// What the files of the kvd._kvd extension share: turning a kvd::Status into the kvd.Error
// subclass for its code, and the Python Client object.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

#include "kvd/client/client.h"
#include "kvd/common/status.h"

namespace kvd::python {

// Sets the Python error indicator to the kvd.Error subclass for `s`'s code (carrying .code,
// .code_name, .message). REQUIRES: the GIL; !s.ok(). For C slots (the buffer protocol), which
// report errors by returning -1 instead of throwing.
void SetError(const Status& s);

// SetError, then throws pybind11::error_already_set (pybind11 raises it in Python).
[[noreturn]] void Raise(const Status& s);

template <typename T>
T Check(StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return std::move(v).value();
}
inline void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

// The Python Client object: close() drops the connection before the object is collected.
struct PyClient {
  std::unique_ptr<client::Client> client;
  client::Client& get() {
    if (!client) Raise(Status::FailedPrecondition("the client is closed"));
    return *client;
  }
};

// Client::Connect with the GIL released; a failure raises.
std::unique_ptr<client::Client> Connect(const client::ClientOptions& o);

// Registers kvd._kvd.ChunkView and kvd._kvd.PutSlot and the Client's zero-copy methods
// (read_in_place, reserve_put, commit_put, flush_releases); in_place.cc.
void BindInPlace(pybind11::module_& m, pybind11::class_<PyClient>& client);

// Registers kvd._kvd.PrefixHolder, PlacementTarget and PlacementResult, the cluster attributes of
// LookupResult (holders, fetched_chunks, found_in) and the Client's placement methods (place,
// connect_placed); cluster.cc.
void BindCluster(pybind11::module_& m, pybind11::class_<PyClient>& client);

}  // namespace kvd::python
