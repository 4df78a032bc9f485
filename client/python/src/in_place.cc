// kvd._kvd.ChunkView and kvd._kvd.PutSlot: the zero-copy calls of libkvd_client
// (Client::ReadInPlace, ReservePut / CommitPut, FlushReleases) for Python. Their bytes are
// exported through the buffer protocol without a copy: memoryview(view), numpy.frombuffer(view),
// numpy.asarray(view) see the arena itself (read-only for a view, writable for a slot).
//
// LIFETIME: a buffer exported from a view or a slot holds a reference to it, and the C++
// ChunkView / PutSlot stays alive while any exported buffer does. release() (or the end of a
// `with` block) asked while buffers are exported marks the object released at once (new exports,
// verify() and commit() raise) and ends the read / aborts the reservation when the last buffer
// is released. commit() with a buffer exported raises BufferError instead: a write after the
// commit would change a published chunk. So no exported buffer ever points at memory kvd may
// have reused, and no use of a released object faults.
#include <pybind11/pybind11.h>

#include <chrono>
#include <string>
#include <utility>

#include "binding.h"
#include "kvd/client/client.h"

namespace py = pybind11;

namespace kvd::python {
namespace {

using client::ChunkForm;
using client::ChunkView;
using client::GetResult;
using client::PutResult;
using client::PutSlot;

const char* FormName(ChunkForm form) {
  switch (form) {
    case ChunkForm::kCompact:
      return "compact";
    case ChunkForm::kRaw:
      return "raw";
    case ChunkForm::kAsStored:
      break;
  }
  return "as_stored";
}

// time.monotonic() seconds of a steady_clock point (both CLOCK_MONOTONIC on Linux), or None for
// the epoch (a kvd that does not say).
py::object MonotonicSeconds(std::chrono::steady_clock::time_point t) {
  if (t == std::chrono::steady_clock::time_point{}) return py::none();
  return py::float_(std::chrono::duration<double>(t.time_since_epoch()).count());
}

// The C++ object behind `self` for a buffer slot, or null with a Python error set.
template <typename T>
T* Unwrap(PyObject* self) {
  try {
    return py::cast<T*>(py::handle(self));
  } catch (const py::cast_error& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
    return nullptr;
  }
}

// Exports [data, data + size) of `obj` (whose Python object is `self`) to a buffer consumer and
// counts the export in obj.users; -1 with the Python error set when refused.
template <typename T>
int Export(T& obj, PyObject* self, Py_buffer* buffer, void* data, size_t size, bool readonly,
           int flags) {
  if (PyBuffer_FillInfo(buffer, self, data, static_cast<Py_ssize_t>(size), readonly ? 1 : 0,
                        flags) != 0) {
    return -1;
  }
  ++obj.users;
  return 0;
}

// bf_releasebuffer: one export of `self` fewer (the last one may end it, T::Unuse).
template <typename T>
void ReleaseExport(PyObject* self, Py_buffer*) {
  if (T* obj = Unwrap<T>(self)) {
    obj->Unuse();
  } else {
    PyErr_Clear();  // cannot fail; the cast cannot either for this type's own objects
  }
}

// ---- ChunkView ----

struct PyChunkView {
  ChunkView view;
  GetResult result;  // the metadata, readable after the release too
  bool verified = false;
  bool device_pinned = false;
  std::chrono::steady_clock::time_point pinned_until{};
  // Exported buffers not yet released, plus verify() calls in progress: the view lives while
  // any is.
  int users = 0;
  bool released = false;  // release() was asked; the read ends when `users` drops to 0

  explicit PyChunkView(ChunkView v)
      : view(std::move(v)),
        result(view.result()),
        verified(view.verified()),
        device_pinned(view.device_pinned()),
        pinned_until(view.pinned_until()) {}
  PyChunkView(const PyChunkView&) = delete;
  PyChunkView& operator=(const PyChunkView&) = delete;
  ~PyChunkView() { End(); }

  Status Usable(const std::string& what) const {
    if (!released) return Status::Ok();
    return Status::FailedPrecondition(
        what +
        ": the ChunkView was released (its chunk is no longer pinned and may be reused); "
        "read it again with read_in_place");
  }
  // Ends the read without the GIL: it may be an exchange with kvd, which waits for a call in
  // progress on the same Client. REQUIRES: the GIL.
  void End() {
    if (!view.valid()) return;
    ChunkView ending = std::move(view);
    py::gil_scoped_release nogil;
    ending.Release();
  }
  void Release() {
    released = true;
    if (users == 0) End();
  }
  void Unuse() {
    if (--users == 0 && released) End();
  }
};

int ViewGetBuffer(PyObject* self, Py_buffer* buffer, int flags) {
  buffer->obj = nullptr;
  PyChunkView* v = Unwrap<PyChunkView>(self);
  if (v == nullptr) return -1;
  if (Status s = v->Usable("ChunkView buffer"); !s.ok()) {
    SetError(s);
    return -1;
  }
  if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE) {
    PyErr_SetString(PyExc_BufferError,
                    "kvd.ChunkView is read-only: a committed chunk is immutable for everyone "
                    "(copy it, e.g. bytearray(view) or numpy.array(view), to change the bytes)");
    return -1;
  }
  return Export(*v, self, buffer, const_cast<std::byte*>(v->view.data()), v->view.size(),
                /*readonly=*/true, flags);
}

// ---- PutSlot ----

struct PyPutSlot {
  PutSlot slot;
  py::object owner;  // the kvd.Client that reserved it (commit() goes through it)
  Hash128 hash;
  int tokens = 0;
  size_t size = 0;
  bool already_stored = false;
  bool device_pinned = false;
  // Exported buffers not yet released: the reservation lives while any is.
  int users = 0;
  // Why the slot takes no more writes ("committed", "aborted", ...); null while open.
  const char* ended = nullptr;
  bool committed = false;

  PyPutSlot(PutSlot s, py::object client)
      : slot(std::move(s)),
        owner(std::move(client)),
        hash(slot.hash()),
        tokens(slot.tokens()),
        size(slot.size()),
        already_stored(slot.already_stored()),
        device_pinned(slot.device_pinned()) {}
  PyPutSlot(const PyPutSlot&) = delete;
  PyPutSlot& operator=(const PyPutSlot&) = delete;
  ~PyPutSlot() {
    if (slot.valid()) AbortNow().IgnoreError();  // dropped uncommitted: nothing becomes visible
  }

  Status Usable(const std::string& what) const {
    if (ended == nullptr) return Status::Ok();
    return Status::FailedPrecondition(what + ": the PutSlot was " + ended +
                                      "; reserve the chunk again with reserve_put");
  }
  // Aborts without the GIL (an exchange with kvd). REQUIRES: the GIL.
  Status AbortNow() {
    if (!slot.valid()) return Status::Ok();
    PutSlot ending = std::move(slot);
    py::gil_scoped_release nogil;
    return ending.Abort();
  }
  // Aborts now, or when the last exported buffer is released. OK for a slot already ended.
  Status Release() {
    if (ended != nullptr) return Status::Ok();
    ended = "released without a commit (aborted)";
    return users == 0 ? AbortNow() : Status::Ok();
  }
  void Unuse() {
    if (--users == 0 && ended != nullptr) AbortNow().IgnoreError();  // best effort, as GC's
  }
};

int SlotGetBuffer(PyObject* self, Py_buffer* buffer, int flags) {
  buffer->obj = nullptr;
  PyPutSlot* s = Unwrap<PyPutSlot>(self);
  if (s == nullptr) return -1;
  Status usable = s->Usable("PutSlot buffer");
  if (usable.ok() && s->already_stored) {
    usable = Status::FailedPrecondition(
        "PutSlot buffer: kvd already holds this chunk, there is nothing to write "
        "(check slot.already_stored; commit() returns at once)");
  }
  if (!usable.ok()) {
    SetError(usable);
    return -1;
  }
  return Export(*s, self, buffer, s->slot.data(), s->size, /*readonly=*/false, flags);
}

// Commits `s` through `c` (Client::CommitPut). The slot is consumed whatever the outcome.
PutResult Commit(PyClient& c, PyPutSlot& s) {
  Check(s.Usable("commit"));
  if (s.users > 0) {
    throw py::buffer_error(
        "commit: " + std::to_string(s.users) +
        " buffer(s) exported from this PutSlot (memoryview, numpy array, ...) are still alive; "
        "release them first (del the array, or write through `with memoryview(slot) as m:`): a "
        "write after the commit would change a published chunk");
  }
  client::Client& client = c.get();
  PutSlot committing = std::move(s.slot);
  s.ended = "committed";
  s.committed = true;
  StatusOr<PutResult> r = Status::Internal("");
  {
    py::gil_scoped_release nogil;
    r = client.CommitPut(std::move(committing));
  }
  if (!r.ok()) {
    s.ended = "consumed by a failed commit (nothing was stored)";
    s.committed = false;
  }
  return Check(std::move(r));
}

void SetBufferSlots(PyHeapTypeObject* heap_type, getbufferproc get, releasebufferproc release) {
  heap_type->ht_type.tp_as_buffer = &heap_type->as_buffer;
  heap_type->as_buffer.bf_getbuffer = get;
  heap_type->as_buffer.bf_releasebuffer = release;
}

// kvd._kvd.ChunkView: a chunk read in place (the buffer protocol over the daemon's bytes).
void BindChunkView(py::module_& m) {
  py::class_<PyChunkView>(m, "ChunkView", py::custom_type_setup([](PyHeapTypeObject* t) {
                            SetBufferSlots(t, ViewGetBuffer, ReleaseExport<PyChunkView>);
                          }))
      .def("__len__", [](const PyChunkView& v) { return v.result.bytes; })
      .def_property_readonly("bytes", [](const PyChunkView& v) { return v.result.bytes; })
      .def_property_readonly("checksum", [](const PyChunkView& v) { return v.result.checksum; })
      .def_property_readonly("tokens", [](const PyChunkView& v) { return v.result.tokens; })
      .def_property_readonly("codec_id", [](const PyChunkView& v) { return v.result.codec_id; })
      .def_property_readonly("form", [](const PyChunkView& v) { return FormName(v.result.form); })
      .def_property_readonly("verified", [](const PyChunkView& v) { return v.verified; })
      .def_property_readonly("device_pinned", [](const PyChunkView& v) { return v.device_pinned; })
      .def_property_readonly("pinned_until",
                             [](const PyChunkView& v) { return MonotonicSeconds(v.pinned_until); })
      .def_property_readonly("released", [](const PyChunkView& v) { return v.released; })
      .def_property_readonly("address",
                             [](const PyChunkView& v) {
                               Check(v.Usable("address"));
                               return reinterpret_cast<uintptr_t>(v.view.data());
                             })
      .def("verify",
           [](PyChunkView& v) {
             Check(v.Usable("verify"));
             ++v.users;  // a release() meanwhile (another thread) waits for the hash
             Status s;
             {
               py::gil_scoped_release nogil;
               s = v.view.Verify();
             }
             if (s.ok()) v.verified = true;
             v.Unuse();
             Check(s);
           })
      .def("release", &PyChunkView::Release)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyChunkView& v, py::args) {
             v.Release();
             return false;
           })
      .def("__repr__", [](const PyChunkView& v) {
        return "ChunkView(bytes=" + std::to_string(v.result.bytes) +
               ", tokens=" + std::to_string(v.result.tokens) + ", form=" + FormName(v.result.form) +
               (v.released ? ", released" : "") + ")";
      });
}

// kvd._kvd.PutSlot: a reserved slot the caller writes before commit (writable buffer protocol).
void BindPutSlot(py::module_& m) {
  py::class_<PyPutSlot>(m, "PutSlot", py::custom_type_setup([](PyHeapTypeObject* t) {
                          SetBufferSlots(t, SlotGetBuffer, ReleaseExport<PyPutSlot>);
                        }))
      .def("__len__", [](const PyPutSlot& s) { return s.size; })
      .def_property_readonly("bytes", [](const PyPutSlot& s) { return s.size; })
      .def_property_readonly("hash", [](const PyPutSlot& s) { return s.hash; })
      .def_property_readonly("tokens", [](const PyPutSlot& s) { return s.tokens; })
      .def_property_readonly("already_stored", [](const PyPutSlot& s) { return s.already_stored; })
      .def_property_readonly("device_pinned", [](const PyPutSlot& s) { return s.device_pinned; })
      .def_property_readonly("committed", [](const PyPutSlot& s) { return s.committed; })
      .def_property_readonly("open", [](const PyPutSlot& s) { return s.ended == nullptr; })
      .def_property_readonly("address",
                             [](const PyPutSlot& s) {
                               Check(s.Usable("address"));
                               return reinterpret_cast<uintptr_t>(s.slot.data());
                             })
      .def("commit", [](PyPutSlot& s) { return Commit(py::cast<PyClient&>(s.owner), s); })
      .def("abort",
           [](PyPutSlot& s) {
             if (s.committed) Raise(Status::FailedPrecondition("abort: the PutSlot is committed"));
             Check(s.Release());
           })
      .def("release", [](PyPutSlot& s) { Check(s.Release()); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyPutSlot& s, py::args) {
             Check(s.Release());
             return false;
           })
      .def("__repr__", [](const PyPutSlot& s) {
        return "PutSlot(hash=" + s.hash.ToHex() + ", tokens=" + std::to_string(s.tokens) +
               ", bytes=" + std::to_string(s.size) + (s.already_stored ? ", already_stored" : "") +
               (s.ended != nullptr ? std::string(", ") + s.ended : std::string()) + ")";
      });
}

// The Client's zero-copy methods: read_in_place, reserve_put, commit_put, flush_releases.
void BindInPlaceCalls(py::class_<PyClient>& client) {
  client
      .def(
          "read_in_place",
          [](PyClient& self, uint64_t lease_id, uint32_t chunk_index, bool verify_checksum,
             bool pin_for_device) {
            client::Client& c = self.get();
            client::ReadInPlaceOptions o;
            o.verify_checksum = verify_checksum;
            o.pin_for_device = pin_for_device;
            StatusOr<ChunkView> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.ReadInPlace(lease_id, chunk_index, o);
            }
            return std::make_unique<PyChunkView>(Check(std::move(r)));
          },
          py::arg("lease_id"), py::arg("chunk_index"), py::arg("verify_checksum") = true,
          py::arg("pin_for_device") = false)
      .def(
          "reserve_put",
          [](py::object self_obj, const Hash128& hash, int tokens, bool pin_for_device) {
            PyClient& self = py::cast<PyClient&>(self_obj);
            client::Client& c = self.get();
            if (tokens <= 0) {
              Raise(Status::InvalidArgument("reserve_put: tokens must be > 0, got " +
                                            std::to_string(tokens)));
            }
            const size_t bytes = client::RawChunkBytes(c.options().layout, tokens);
            client::ReservePutOptions o;
            o.pin_for_device = pin_for_device;
            StatusOr<PutSlot> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.ReservePut(hash, tokens, bytes, o);
            }
            return std::make_unique<PyPutSlot>(Check(std::move(r)), std::move(self_obj));
          },
          py::arg("hash"), py::arg("tokens"), py::arg("pin_for_device") = false)
      .def("commit_put", &Commit, py::arg("slot"))
      .def("flush_releases", [](PyClient& self) {
        client::Client& c = self.get();
        Status s;
        {
          py::gil_scoped_release nogil;
          s = c.FlushReleases();
        }
        Check(s);
      });
}

}  // namespace

void BindInPlace(py::module_& m, py::class_<PyClient>& client) {
  BindChunkView(m);
  BindPutSlot(m);
  BindInPlaceCalls(client);
}

}  // namespace kvd::python
