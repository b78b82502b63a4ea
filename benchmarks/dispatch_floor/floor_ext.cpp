// A C++ boxed fallback that only passes each op on: the floor of intercepting
// ops below autograd without a Python dispatch mode (benchmarks/bench_dispatch_floor.py).
//
// Not part of dtr: a measuring device. It takes the `Fake` dispatch key, which
// torch 2.13 reserves for a C++ FakeTensor mode and registers nothing for;
// including the key in the thread's dispatch key set sends every op below
// autograd through `passthrough`, which (like a Python mode, popped while its
// handler runs) excludes itself while the op runs, so ops that kernels call
// inside are not seen again.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <map>
#include <string>

namespace {

int g_level = 0;  // 0: pass on; 1: also read every tensor argument's storage; 2: also convert the arguments to Python
int64_t g_seen = 0;
int64_t g_sink = 0;
bool g_count_names = false;
std::map<std::string, int64_t> g_names;

void passthrough(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  ++g_seen;
  if (g_count_names) {
    const auto& name = op.schema().operator_name();
    const auto sep = name.name.rfind("::");
    const std::string base = sep == std::string::npos ? name.name : name.name.substr(sep + 2);
    g_names[base + "." + (name.overload_name.empty() ? std::string("default") : name.overload_name)]++;
  }
  if (g_level >= 1) {
    auto args = torch::jit::last(*stack, op.schema().arguments().size());
    for (const auto& a : args)
      if (a.isTensor() && a.toTensor().defined() && a.toTensor().has_storage())
        g_sink += a.toTensor().storage().use_count();
    if (g_level >= 2) {
      pybind11::gil_scoped_acquire gil;
      pybind11::tuple t(args.size());
      for (size_t i = 0; i < args.size(); ++i) t[i] = torch::jit::toPyObject(args[i]);
      g_sink += PyTuple_GET_SIZE(t.ptr());
    }
  }
  c10::impl::ExcludeDispatchKeyGuard off(c10::DispatchKey::Fake);
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&passthrough>()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable", [](bool on, int level, bool count_names) {
    g_level = level;
    g_count_names = count_names;
    c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::Fake, on);
  });
  m.def("seen", []() { return g_seen; });
  m.def("names", []() { auto r = g_names; g_names.clear(); return r; });
}
