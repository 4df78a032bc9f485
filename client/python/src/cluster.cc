// The cluster side of kvd._kvd: what a cluster-scope lookup reports (LookupResult.holders,
// .fetched_chunks, .found_in, .membership_current, .membership_age_ms) and placement for prefill
// (Client.place, Client.connect_placed).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "binding.h"
#include "kvd/client/client.h"

namespace py = pybind11;

namespace kvd::python {
namespace {

using client::LookupResult;
using client::PlacementResult;
using client::PlacementTarget;
using client::PrefixHolder;

// {tier: chunks}, e.g. {"host": 3}.
py::dict TierDict(const std::vector<client::TierChunks>& tiers) {
  py::dict d;
  for (const auto& t : tiers) d[py::str(t.tier)] = t.chunks;
  return d;
}

std::string Quoted(const std::string& s) { return py::repr(py::str(s)).cast<std::string>(); }

std::string TargetRepr(const PlacementTarget& t) {
  return "PlacementTarget(node=" + Quoted(t.node) +
         ", control_address=" + Quoted(t.control_address) +
         ", local=" + (t.local ? "True" : "False") + ")";
}

void BindResults(py::module_& m) {
  py::class_<PrefixHolder>(m, "PrefixHolder")
      .def_readonly("node", &PrefixHolder::node)
      .def_readonly("matched_chunks", &PrefixHolder::matched_chunks)
      .def_readonly("error", &PrefixHolder::error)
      .def_property_readonly("found_in", [](const PrefixHolder& h) { return TierDict(h.found_in); })
      .def("__repr__", [](const PrefixHolder& h) {
        return "PrefixHolder(node=" + Quoted(h.node) +
               ", matched_chunks=" + std::to_string(h.matched_chunks) +
               ", error=" + Quoted(h.error) +
               ", found_in=" + py::repr(TierDict(h.found_in)).cast<std::string>() + ")";
      });
  py::class_<PlacementTarget>(m, "PlacementTarget")
      .def_readonly("node", &PlacementTarget::node)
      .def_readonly("control_address", &PlacementTarget::control_address)
      .def_readonly("local", &PlacementTarget::local)
      .def("__repr__", &TargetRepr);
  py::class_<PlacementResult>(m, "PlacementResult")
      .def_readonly("targets", &PlacementResult::targets)
      .def_readonly("membership_current", &PlacementResult::membership_current)
      .def_readonly("membership_age_ms", &PlacementResult::membership_age_ms)
      .def("__repr__", [](const PlacementResult& r) {
        std::string out = "PlacementResult(targets=[";
        for (size_t i = 0; i < r.targets.size(); ++i) {
          out += (i ? ", " : "") + TargetRepr(r.targets[i]);
        }
        return out + "], membership_current=" + (r.membership_current ? "True" : "False") +
               ", membership_age_ms=" + std::to_string(r.membership_age_ms) + ")";
      });
  // LookupResult is registered in module.cc; its cluster-scope attributes are added here.
  py::reinterpret_borrow<py::class_<LookupResult>>(m.attr("LookupResult"))
      .def_readonly("holders", &LookupResult::holders)
      .def_readonly("fetched_chunks", &LookupResult::fetched_chunks)
      .def_readonly("membership_current", &LookupResult::membership_current)
      .def_readonly("membership_age_ms", &LookupResult::membership_age_ms)
      .def_property_readonly("found_in",
                             [](const LookupResult& r) { return TierDict(r.found_in); });
}

}  // namespace

void BindCluster(py::module_& m, py::class_<PyClient>& client) {
  BindResults(m);
  client
      .def(
          "place",
          [](PyClient& self, const std::vector<Hash128>& chain, const std::string& node) {
            client::Client& c = self.get();
            StatusOr<PlacementResult> r = Status::Internal("");
            {
              py::gil_scoped_release nogil;
              r = c.Place(chain, {.node = node});
            }
            return Check(std::move(r));
          },
          py::arg("chain"), py::kw_only(), py::arg("node") = "")
      .def(
          "connect_placed",
          [](PyClient& self, const PlacementTarget& target) {
            client::Client& c = self.get();
            return PyClient{Connect(client::PlacedOptions(c.options(), target))};
          },
          py::arg("target"));
}

}  // namespace kvd::python
