// bindings.cpp - the pybind11 module dtr._C. Reached only through dtr.core and
// dtr.sim (the Python facade); see dtr/_C.pyi for the typed surface.
#include <pybind11/functional.h>
#include <pybind11/native_enum.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <cstring>

#include "core.h"
#include "core_api.h"
#include "depth_pool.h"
#include "fastsa.h"
#include "program.h"
#include "replay.h"

namespace py = pybind11;
using namespace dtr;

namespace {

PyObject* g_log_error = nullptr;
PyObject* g_oom = nullptr;
PyObject* g_thrash = nullptr;

py::dict counters_dict(const Counters& c) {
  py::dict d;
  d["base_compute"] = c.base_compute;
  d["remat_compute"] = c.remat_compute;
  d["evictions"] = c.evictions;
  d["eager_evictions"] = c.eager_evictions;
  d["banishments"] = c.banishments;
  d["remats"] = c.remats;
  d["base_ops"] = c.base_ops;
  d["memory"] = c.memory;
  d["peak_memory"] = c.peak_memory;
  d["storage_accesses"] = c.storage_accesses;
  d["heuristic_evals"] = c.heuristic_evals;
  d["largest_op_bytes"] = c.largest_op_bytes;
  d["constant_bytes"] = c.constant_bytes;
  d["planned_evictions"] = c.planned_evictions;
  d["planned_remats"] = c.planned_remats;
  return d;
}

CostMode cost_mode(const std::string& s) {
  if (s == "none") return CostMode::None;
  if (s == "local") return CostMode::Local;
  if (s == "eqclass") return CostMode::EqClass;
  if (s == "full") return CostMode::Full;
  throw py::value_error("unknown cost mode '" + s + "' (valid: full, eqclass, local, none)");
}

std::string cost_name(CostMode m) {
  switch (m) {
    case CostMode::None: return "none";
    case CostMode::Local: return "local";
    case CostMode::EqClass: return "eqclass";
    case CostMode::Full: return "full";
  }
  return "?";
}

// Tuples built directly (replay_graph hands over tables of thousands of rows).
PyObject* to_py(int x) { return PyLong_FromLong(x); }
PyObject* to_py(int64_t x) { return PyLong_FromLongLong(x); }
PyObject* to_py(double x) { return PyFloat_FromDouble(x); }
PyObject* to_py(char x) { return PyBool_FromLong(x); }

template <class T>
PyObject* to_py(const std::vector<T>& v) {
  PyObject* out = PyTuple_New(Py_ssize_t(v.size()));
  if (!out) throw py::error_already_set();
  for (size_t k = 0; k < v.size(); ++k) {
    PyObject* x = to_py(v[k]);
    if (!x) {
      Py_DECREF(out);
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(out, Py_ssize_t(k), x);
  }
  return out;
}

template <class T>
py::object tuple_of(const std::vector<T>& v) {
  return py::reinterpret_steal<py::object>(to_py(v));
}

// dtr._C.ReplayStatus: a str enum (OK = "ok", ...) of the names status_name() gives, so that
// Python compares the result's status string with it; enum.StrEnum where there is one.
py::object replay_status_enum(py::module_& m) {
  py::module_ enum_mod = py::module_::import("enum");
  py::list members;
  for (ReplayStatus s : kReplayStatuses) {
    std::string name = status_name(s);
    for (char& ch : name) ch = char(std::toupper(static_cast<unsigned char>(ch)));
    members.append(py::make_tuple(name, status_name(s)));
  }
  py::dict kwargs;
  kwargs["module"] = m.attr("__name__");
  kwargs["qualname"] = "ReplayStatus";
  if (py::hasattr(enum_mod, "StrEnum")) return enum_mod.attr("StrEnum")("ReplayStatus", members, **kwargs);
  kwargs["type"] = py::module_::import("builtins").attr("str");
  return enum_mod.attr("Enum")("ReplayStatus", members, **kwargs);
}

py::list trace_list(const std::vector<std::pair<TraceEvent, int>>& trace) {
  py::list out(trace.size());
  for (size_t k = 0; k < trace.size(); ++k)
    out[k] = py::make_tuple(static_cast<int>(trace[k].first), trace[k].second);
  return out;
}

// A pin reason from Python (an int of dtr._C.Hold), checked.
Hold hold_of(int why) {
  if (why < 0 || why > static_cast<int>(Hold::Pinned))
    throw py::value_error("a pin reason is one of Hold's first six values (got " + std::to_string(why) + ")");
  return static_cast<Hold>(why);
}

// ----- Note [The core's C route] (core_api.h): the table's functions.
Core& as_core(void* c) { return *static_cast<Core*>(c); }

// The bound method's exception, raised in Python by the module's own translators.
int failed() {
  try {
    throw;
  } catch (...) {
    py::detail::try_translate_exceptions();
  }
  return -1;
}

template <class F>
auto guarded(F&& f, decltype(f()) on_error) -> decltype(f()) {
  try {
    return f();
  } catch (...) {
    failed();
    return on_error;
  }
}

// begin_call's argument vectors, kept between calls (Note [Scratch by nesting depth] in depth_pool.h).
struct CallArgs {
  std::vector<int> inputs, none, inplace_of;
  std::vector<int64_t> sizes;
};

// Core::begin_call from the table's arrays; inplace_of may be null (no output is a new version).
int table_begin_call(void* c, const int* inputs, int n_in, const int64_t* sizes, const int* inplace_of, int n_out,
                     double cost) {
  return guarded([&] {
    DepthLease<CallArgs> lease;
    CallArgs& a = *lease;
    a.inputs.assign(inputs, inputs + n_in);
    a.sizes.assign(sizes, sizes + n_out);
    a.none.assign(size_t(n_out), -1);
    if (inplace_of != nullptr) a.inplace_of.assign(inplace_of, inplace_of + n_out);
    return as_core(c).begin_call(a.inputs, a.sizes, a.none, inplace_of != nullptr ? a.inplace_of : a.none, cost);
  }, -1);
}

const DtrCoreApi core_api = {
    DTR_CORE_API_VERSION,
    [](void* c, int t) { return guarded([&] { return as_core(c).storage_of(t); }, -1); },
    [](void* c, int t) { return guarded([&] { return int(as_core(c).defined(t)); }, -1); },
    [](void* c, int s) { return guarded([&] { return int(as_core(c).pinned(s)); }, -1); },
    [](void* c, int s) { return guarded([&] { return int(as_core(c).resident(s)); }, -1); },
    [](void* c, int s) { return guarded([&] { return int64_t(as_core(c).storage_refs(s)); }, int64_t(-1)); },
    [](void* c) { return int64_t(as_core(c).counters().memory); },
    [](void* c) { return int64_t(as_core(c).counters().peak_memory); },
    [](void* c) { return int64_t(as_core(c).budget()); },
    [](void* c) { return as_core(c).counters().base_compute; },
    [](void* c) { return as_core(c).counters().remat_compute; },
    [](void* c, double limit) { as_core(c).set_thrash_limit(limit); },
    [](void* c, const int* inputs, int n_in, const int64_t* sizes, int n_out, double cost) {
      return table_begin_call(c, inputs, n_in, sizes, nullptr, n_out, cost);
    },
    [](void* c, int op, double cost) { return guarded([&] { as_core(c).end_call(op, cost); return 0; }, -1); },
    [](void* c, int op) { return guarded([&] { as_core(c).abort_call(op); return 0; }, -1); },
    [](void* c, int op, int* out, int cap) {
      return guarded([&] {
        const std::vector<int>& o = as_core(c).op_outputs(op);
        for (size_t k = 0; k < o.size() && int(k) < cap; ++k) out[k] = o[k];
        return int(o.size());
      }, -1);
    },
    [](void* c, int t) { return guarded([&] { as_core(c).release(t); return 0; }, -1); },
    [](void* c, int s) { return guarded([&] { as_core(c).forget(s); return 0; }, -1); },
    &remat_allowance,
    [](void* c, int on) { as_core(c).compute_hook_first = on != 0; },
    [](void* c, int64_t size) { return guarded([&] { return as_core(c).constant(size); }, -1); },
    [](void* c, int (*fn)(void*, int, int), void* ctx) {
      return guarded([&] {
        if (fn == nullptr) {
          as_core(c).on_evict = nullptr;
          return 0;
        }
        // (the hook holds ctx, as a Python callable hook holds its object; it runs with the GIL held)
        py::object keep = py::reinterpret_borrow<py::object>(static_cast<PyObject*>(ctx));
        as_core(c).on_evict = [fn, keep](int s, bool by_heuristic) {
          if (fn(keep.ptr(), s, by_heuristic ? 1 : 0) < 0) throw py::error_already_set();
        };
        return 0;
      }, -1);
    },
    &table_begin_call,
    [](void* c, int s) { return guarded([&] { return int64_t(as_core(c).storage_size(s)); }, int64_t(-1)); },
    [](void* c, int s, int* out, int cap) {
      return guarded([&] {
        const std::vector<int> d = as_core(c).protect_targets(s);
        for (size_t k = 0; k < d.size() && int(k) < cap; ++k) out[k] = d[k];
        return int(d.size());
      }, -1);
    },
    [](void* c, int s) { return guarded([&] { as_core(c).protect(s); return 0; }, -1); },
    [](void* c, int s) { return guarded([&] { return int(as_core(c).storage_dependents(s).size()); }, -1); },
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dtr's C++ eviction core (torch-free). Use dtr.core / dtr.sim, not this module.";

  g_log_error = PyErr_NewException("dtr._C.LogError", PyExc_ValueError, nullptr);
  g_oom = PyErr_NewException("dtr._C.OutOfMemory", PyExc_MemoryError, nullptr);
  g_thrash = PyErr_NewException("dtr._C.Thrashing", PyExc_RuntimeError, nullptr);
  m.attr("LogError") = py::handle(g_log_error);
  m.attr("OutOfMemory") = py::handle(g_oom);
  m.attr("Thrashing") = py::handle(g_thrash);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const LogError& e) {
      // The reader quotes the log's text, which need not be UTF-8: never fail on the message.
      const char* what = e.what();
      py::object msg = py::reinterpret_steal<py::object>(
          PyUnicode_DecodeUTF8(what, Py_ssize_t(std::strlen(what)), "backslashreplace"));
      if (!msg) throw py::error_already_set();
      PyErr_SetObject(g_log_error, py::make_tuple(e.line, msg).ptr());
    } catch (const OutOfMemory& e) {
      py::list held;  // (storage, bytes, Hold, referenced), largest first
      for (const Held& h : e.held) held.append(py::make_tuple(h.storage, h.size, static_cast<int>(h.why), h.referenced));
      PyErr_SetObject(g_oom, py::make_tuple(e.needed, e.budget, e.what(), e.request, e.op, e.remat_op, e.evictable,
                                            held).ptr());
    } catch (const Thrashing& e) {
      PyErr_SetObject(g_thrash,
                      py::make_tuple(e.remat_compute, e.limit, e.what(), e.remats, e.count_limit).ptr());
    }
  });

  py::native_enum<InstrKind>(m, "InstrKind", "enum.IntEnum",
                             "An instruction's kind: the int kind of Program.records().")
      .value("CONSTANT", InstrKind::Constant)
      .value("CALL", InstrKind::Call)
      .value("MUTATE", InstrKind::Mutate)
      .value("COPY", InstrKind::Copy)
      .value("COPYFROM", InstrKind::CopyFrom)
      .value("RELEASE", InstrKind::Release)
      .value("PIN", InstrKind::Pin)
      .value("PROTECT", InstrKind::Protect)
      .value("COLLECT", InstrKind::Collect)
      .value("READ", InstrKind::Read)
      .finalize();
  py::native_enum<TraceEvent>(m, "TraceEvent", "enum.IntEnum",
                              "The kind of a replay's trace entry (kind, id): ids are core ops or storages.")
      .value("COMPUTED", TraceEvent::Computed, "an op computed for the first time (id: op)")
      .value("RECOMPUTED", TraceEvent::Recomputed, "an op recomputed (id: op)")
      .value("EVICTED", TraceEvent::Evicted, "a storage evicted by the heuristic (id: storage)")
      .value("FREED", TraceEvent::Freed, "a storage freed otherwise: last release, collected, banished (id: storage)")
      .finalize();
  m.attr("ReplayStatus") = replay_status_enum(m);
  py::native_enum<Hold>(m, "Hold", "enum.IntEnum",
                        "Why a resident storage could not be evicted (Note [What filled the budget]).")
      .value("CONSTANT", Hold::Constant, "a constant: it existed before the program")
      .value("PROTECTED", Hold::Protected, "pinned: computed from a constant that was written or dropped")
      .value("ESCAPED", Hold::Escaped, "pinned: its bytes were read outside the graph")
      .value("VERSION_CHAIN", Hold::VersionChain, "pinned: a long chain of in-place versions")
      .value("OUTPUT", Hold::Output, "pinned: held by the program at its end")
      .value("PINNED", Hold::Pinned, "pinned by the driver")
      .value("INPUT", Hold::Input, "locked: an input of the op whose room was being made")
      .value("RECOMPUTE", Hold::Recompute, "locked: read by a recomputation in progress")
      .value("LOCKED", Hold::Locked, "locked by the driver")
      .finalize();

  py::class_<Semantics>(m, "Semantics")
      .def(py::init([](bool free_dead_constants, bool keep_needed, bool eqclass_split, bool inplace_handover,
                       bool deep_first) {
             return Semantics{free_dead_constants, keep_needed, eqclass_split, inplace_handover, deep_first};
           }),
           py::arg("free_dead_constants") = false, py::arg("keep_needed") = false, py::arg("eqclass_split") = false,
           py::arg("inplace_handover") = false, py::arg("deep_first") = false)
      .def_readwrite("free_dead_constants", &Semantics::free_dead_constants)
      .def_readwrite("keep_needed", &Semantics::keep_needed)
      .def_readwrite("eqclass_split", &Semantics::eqclass_split)
      .def_readwrite("inplace_handover", &Semantics::inplace_handover)
      .def_readwrite("deep_first", &Semantics::deep_first);

  py::class_<Config>(m, "Config")
      .def(py::init<>())
      .def_readwrite("budget", &Config::budget)
      .def_property(
          "cost", [](const Config& c) { return cost_name(c.cost); },
          [](Config& c, const std::string& s) { c.cost = cost_mode(s); })
      .def_readwrite("use_size", &Config::use_size)
      .def_readwrite("use_staleness", &Config::use_staleness)
      .def_readwrite("random", &Config::random)
      .def_readwrite("banish", &Config::banish)
      .def_readwrite("seed", &Config::seed)
      .def_readwrite("sample", &Config::sample)
      .def_readwrite("semantics", &Config::semantics)
      .def_readwrite("thrash_limit", &Config::thrash_limit)
      .def_readwrite("thrash_base", &Config::thrash_base)
      .def_readwrite("thrash_base_ops", &Config::thrash_base_ops)
      .def_readwrite("remat_limit", &Config::remat_limit);

  m.attr("_core_api") = py::capsule(static_cast<const void*>(&core_api), DTR_CORE_API_CAPSULE);

  py::class_<Core>(m, "Core")
      .def(py::init<const Config&>(), py::arg("config"))
      .def("_capsule", [](Core& c) { return py::capsule(static_cast<void*>(&c), DTR_CORE_CAPSULE); },
           "This core's address, for the C route of core_api.h (valid while this object lives).")
      .def("constant", &Core::constant, py::arg("size"))
      .def("call", &Core::call, py::arg("inputs"), py::arg("sizes"), py::arg("alias_of"), py::arg("cost"))
      .def("mutate", &Core::mutate, py::arg("inputs"), py::arg("mutated"), py::arg("cost"))
      .def("mutate_inplace", &Core::mutate_inplace, py::arg("inputs"), py::arg("mutated"), py::arg("cost"))
      .def("call_inplace", &Core::call_inplace, py::arg("inputs"), py::arg("sizes"), py::arg("alias_of"),
           py::arg("mutated"), py::arg("cost"))
      .def("begin_call", &Core::begin_call, py::arg("inputs"), py::arg("sizes"), py::arg("alias_of"),
           py::arg("inplace_of"), py::arg("cost"))
      .def("end_call", &Core::end_call, py::arg("op"), py::arg("cost"))
      .def("abort_call", &Core::abort_call, py::arg("op"))
      .def("set_cost", &Core::set_cost, py::arg("op"), py::arg("cost"))
      .def("protect", &Core::protect, py::arg("storage"))
      .def("protect_targets", &Core::protect_targets, py::arg("storage"))
      .def("collect", &Core::collect)
      .def("compact",
           [](Core& c) {
             Core::Remap r = c.compact();
             return py::make_tuple(std::move(r.ops), std::move(r.tensors), std::move(r.storages));
           })
      .def_property_readonly("num_collected_storages", &Core::num_collected_storages)
      .def("collected", &Core::collected, py::arg("s"))
      .def("op_collected", &Core::op_collected, py::arg("op"))
      .def("storage_tensors", &Core::storage_tensors, py::arg("s"))
      .def("retain", &Core::retain, py::arg("t"))
      .def("release", &Core::release, py::arg("t"))
      .def("require", &Core::require, py::arg("t"))
      .def("pin", [](Core& c, int t, int why) { c.pin(t, hold_of(why)); }, py::arg("t"),
           py::arg("why") = static_cast<int>(Hold::Pinned))
      .def("pin_many", [](Core& c, const std::vector<int>& ts, int why) { c.pin_many(ts, hold_of(why)); },
           py::arg("ts"), py::arg("why") = static_cast<int>(Hold::Pinned),
           "pin(t, why) for each t in order, as one materialization (Note [Planned recomputation]).")
      .def("pin_reason", [](const Core& c, int s) { return static_cast<int>(c.pin_reason(s)); }, py::arg("s"))
      .def("lock", &Core::lock, py::arg("s"))
      .def("unlock", &Core::unlock, py::arg("s"))
      .def("counters", [](const Core& c) { return counters_dict(c.counters()); })
      .def("set_plan", &Core::set_plan, py::arg("plan"))
      .def("record_fingerprints", &Core::record_fingerprints, py::arg("on"))
      .def("fingerprints", &Core::fingerprints)
      .def_property_readonly("following", &Core::following)
      .def_property_readonly("plan_followed", &Core::plan_followed)
      .def_property_readonly("plan_diverged_at", &Core::plan_diverged_at)
      .def_property_readonly("start_memory", &Core::start_memory)
      .def_property_readonly("plan_length", &Core::plan_length)
      .def_property_readonly("clock", &Core::clock)
      .def_property_readonly("memory", [](const Core& c) { return c.counters().memory; })
      .def_property_readonly("peak_memory", [](const Core& c) { return c.counters().peak_memory; })
      .def_property_readonly("remat_compute", [](const Core& c) { return c.counters().remat_compute; })
      .def_property_readonly("base_compute", [](const Core& c) { return c.counters().base_compute; })
      .def_property("budget", &Core::budget, &Core::set_budget)
      .def("set_thrash_limit", &Core::set_thrash_limit, py::arg("limit"))
      .def("set_remat_limit", &Core::set_remat_limit, py::arg("limit"))
      .def_property_readonly("thrash_limit", &Core::thrash_limit)
      .def("remat_allowed", &Core::remat_allowed)
      .def("remats_allowed", &Core::remats_allowed)
      .def("restart_peak", &Core::restart_peak)
      .def("raise_peak", &Core::raise_peak, py::arg("peak"))
      .def("fit_budget", &Core::fit_budget)
      .def_property_readonly("num_tensors", &Core::num_tensors)
      .def_property_readonly("num_storages", &Core::num_storages)
      .def_property_readonly("num_ops", &Core::num_ops)
      .def_property_readonly("pool_size", &Core::pool_size)
      .def("storage_of", &Core::storage_of, py::arg("t"))
      .def("op_of", &Core::op_of, py::arg("t"))
      .def("defined", &Core::defined, py::arg("t"))
      .def("resident", &Core::resident, py::arg("s"))
      .def("banished", &Core::banished, py::arg("s"))
      .def("handed", &Core::handed, py::arg("s"))
      .def("pinned", &Core::pinned, py::arg("s"))
      .def("locks", &Core::locks, py::arg("s"))
      .def("refs", &Core::refs, py::arg("t"))
      .def("storage_refs", &Core::storage_refs, py::arg("s"))
      .def("storage_deps", &Core::storage_deps, py::arg("s"))
      .def("storage_dependents", &Core::storage_dependents, py::arg("s"))
      .def("forget", &Core::forget, py::arg("s"))
      .def("storage_size", &Core::storage_size, py::arg("s"))
      .def("storage_cost", &Core::storage_cost, py::arg("s"))
      .def("neighbourhood_cost", &Core::neighbourhood_cost, py::arg("s"))
      .def("check", &Core::check)
      .def_readwrite("on_evict", &Core::on_evict)
      .def_readwrite("on_compute", &Core::on_compute)
      .def_readwrite("on_pin", &Core::on_pin)
      .def("op_inputs", &Core::op_inputs, py::arg("op"))
      .def("op_outputs", &Core::op_outputs, py::arg("op"))
      .def("op_sizes", &Core::op_sizes, py::arg("op"))
      .def("op_cost", &Core::op_cost, py::arg("op"))
      .def("tensor_index", &Core::tensor_index, py::arg("t"))
      .def("is_alias", &Core::is_alias, py::arg("t"))
      .def("storage_root", &Core::storage_root, py::arg("s"));

  py::class_<FollowPlan>(m, "FollowPlan")
      .def(py::init([](std::vector<uint64_t> fingerprints, std::vector<int> starts,
                       const std::vector<std::tuple<int, int, int>>& steps, int64_t start_limit) {
             if (start_limit < -1) throw std::invalid_argument("start_limit must be >= 0 bytes, or -1 for any");
             FollowPlan p{std::move(fingerprints), std::move(starts), {}, start_limit};
             p.steps.reserve(steps.size());
             for (const auto& [kind, op, index] : steps) p.steps.push_back(PlanStep{kind, op, index});
             return p;
           }),
           py::arg("fingerprints"), py::arg("starts"), py::arg("steps"), py::arg("start_limit") = -1)
      .def_readonly("start_limit", &FollowPlan::start_limit)
      .def_readonly("fingerprints", &FollowPlan::fingerprints)
      .def_readonly("starts", &FollowPlan::starts)
      .def_property_readonly("steps", [](const FollowPlan& p) {
        py::list out;
        for (const PlanStep& st : p.steps) out.append(py::make_tuple(st.kind, st.op, st.index));
        return out;
      })
      .def("__len__", [](const FollowPlan& p) { return p.fingerprints.size(); });

  py::class_<Program>(m, "Program")
      .def_readonly("format", &Program::format)
      .def_readonly("cost_unit", &Program::cost_unit)
      .def_readonly("meta_json", &Program::meta_json)
      .def_readonly("meta_line", &Program::meta_line)
      .def_readonly("handle_names", &Program::handle_names)
      .def_readonly("names", &Program::names)
      .def("base_compute", &Program::base_compute)
      .def("base_ops", &Program::base_ops)
      .def("__len__", [](const Program& p) { return p.instrs.size(); })
      .def("records", [](const Program& p) {
        py::list out;
        for (const Instr& i : p.instrs)
          out.append(py::make_tuple(static_cast<int>(i.kind), i.line, i.name, i.cost, i.in, i.out, i.sizes,
                                    i.aliases, i.mutated, i.inplace));
        return out;
      });

  m.def("remat_allowance", &remat_allowance, py::arg("thrash_limit"), py::arg("base"));
  m.def("remat_count_allowance", &remat_count_allowance, py::arg("thrash_limit"), py::arg("base_ops"));

  m.def(
      "parse_log",
      [](py::bytes data) {
        std::string text = data;
        py::gil_scoped_release nogil;
        return parse_log(text);
      },
      py::arg("data"));

  m.def(
      "replay",
      [](const Program& prog, const Config& cfg, bool check, bool trace, const FollowPlan* plan,
         bool fingerprints) {
        ReplayResult r;
        {
          py::gil_scoped_release nogil;
          r = replay(prog, cfg, check, trace, plan, fingerprints);
        }
        py::dict d = counters_dict(r.counters);
        d["status"] = status_name(r.status);
        d["base_total"] = r.base_total;
        d["needed_bytes"] = r.needed_bytes;
        d["failed_line"] = r.failed_line;
        d["instructions"] = r.instructions;
        if (fingerprints) {
          d["fingerprints"] = r.fingerprints;
          d["start_memory"] = r.start_memory;
        }
        if (plan != nullptr) {
          d["plan_followed"] = r.plan_followed;
          d["plan_diverged_at"] = r.plan_diverged_at;
        }
        if (trace) {
          d["trace"] = trace_list(r.trace);
          d["op_instr"] = r.op_instr;
          d["storage_op"] = r.storage_op;
          d["storage_index"] = r.storage_index;
        }
        return d;
      },
      py::arg("program"), py::arg("config"), py::arg("check") = false,
      py::arg("trace") = false, py::arg("plan") = nullptr, py::arg("fingerprints") = false);

  m.def(
      "replay_graph",
      [](const Program& prog, const Config& cfg) {
        ReplayGraph g;
        {
          py::gil_scoped_release nogil;
          g = replay_graph(prog, cfg);
        }
        py::dict d;
        d["op_instr"] = tuple_of(g.op_instr);
        d["op_kind"] = tuple_of(g.op_kind);
        d["op_line"] = tuple_of(g.op_line);
        d["op_name"] = tuple_of(g.op_name);
        d["op_cost"] = tuple_of(g.op_cost);
        d["op_inputs"] = tuple_of(g.op_inputs);
        d["op_outputs"] = tuple_of(g.op_outputs);
        d["op_fresh"] = tuple_of(g.op_fresh);
        d["op_alloc"] = tuple_of(g.op_alloc);
        d["op_overwrites"] = tuple_of(g.op_overwrites);
        d["tensor_op"] = tuple_of(g.tensor_op);
        d["tensor_storage"] = tuple_of(g.tensor_storage);
        d["tensor_view"] = tuple_of(g.tensor_alias);
        d["storage_size"] = tuple_of(g.storage_size);
        d["storage_op"] = tuple_of(g.storage_op);
        d["storage_tensors"] = tuple_of(g.storage_tensors);
        d["referenced_at_end"] = tuple_of(g.referenced_at_end);
        return d;
      },
      py::arg("program"), py::arg("config"));
  m.def(
      "fastsa_anneal",
      [](std::vector<int> in_ptr, std::vector<int> in_idx, std::vector<int> out_ptr, std::vector<int> out_idx,
         std::vector<int64_t> extra, std::vector<double> cost, std::vector<uint8_t> unit_flags,
         std::vector<int64_t> size, std::vector<uint8_t> value_flags, std::vector<int> slots, int64_t budget,
         int64_t iterations, double temp0, double temp1, double temp_scale, uint64_t seed, double time_limit,
         bool stop_when_feasible, bool soft_peak, bool keep_order) {
        FastsaProblem p{std::move(in_ptr), std::move(in_idx), std::move(out_ptr), std::move(out_idx),
                        std::move(extra), std::move(cost), std::move(unit_flags), std::move(size),
                        std::move(value_flags)};
        FastsaParams par;
        par.budget = budget;
        par.iterations = iterations;
        par.temp0 = temp0;
        par.temp1 = temp1;
        par.temp_scale = temp_scale;
        par.seed = seed;
        par.time_limit = time_limit;
        par.stop_when_feasible = stop_when_feasible;
        par.soft_peak = soft_peak;
        par.keep_order = keep_order;
        FastsaResult r;
        {
          py::gil_scoped_release nogil;
          r = fastsa_anneal(p, std::move(slots), par);
        }
        py::dict d;
        d["slots"] = r.slots;
        d["iterations"] = r.iterations;
        d["accepted"] = r.accepted;
        d["peak"] = r.peak;
        d["cost"] = r.cost;
        d["feasible"] = r.feasible;
        d["objective0"] = r.objective0;
        d["temp_end"] = r.temp_end;
        d["peak0"] = r.peak0;
        return d;
      },
      py::arg("in_ptr"), py::arg("in_idx"), py::arg("out_ptr"), py::arg("out_idx"), py::arg("extra"),
      py::arg("cost"), py::arg("unit_flags"), py::arg("size"), py::arg("value_flags"), py::arg("slots"), py::arg("budget"), py::arg("iterations"), py::arg("temp0"), py::arg("temp1"),
      py::arg("temp_scale"), py::arg("seed"), py::arg("time_limit"), py::arg("stop_when_feasible"),
      py::arg("soft_peak") = false, py::arg("keep_order") = false);
}
