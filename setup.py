"""Build the C++ core ``dtr._C`` (pybind11, torch-free) and, where torch is importable at build time,
the native per-op path ``dtr._native`` (built against that torch); all metadata lives in pyproject.toml.

``dtr._native`` is optional: when torch is missing from the build environment (``pip install .``
with build isolation), when ``DTR_BUILD_NATIVE=0``, or when it fails to compile, the build goes
on without it and the runtime runs its Python reference (dtr/runtime/native.py warns once).
"""
import os
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import Extension, setup

ext_modules = [
    Pybind11Extension(
        "dtr._C",
        [
            # The core (core.h), one file per subsystem.
            "csrc/core_graph.cpp", "csrc/core_materialize.cpp", "csrc/core_evict.cpp", "csrc/core_eqclass.cpp",
            "csrc/core_compact.cpp", "csrc/core_check.cpp",
            # Logs (program.h) and their replay (replay.h), and the Python module.
            "csrc/logparse.cpp", "csrc/replay.cpp", "csrc/bindings.cpp",
            # The FastSA planner's annealing loop (dtr/sim/planners/fastsa.py).
            "csrc/fastsa.cpp",
        ],
        depends=["csrc/core.h", "csrc/core_internal.h", "csrc/core_api.h", "csrc/depth_pool.h", "csrc/program.h",
                 "csrc/replay.h", "csrc/fastsa.h"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]


def _native_extension():
    """``dtr._native`` against the torch of this build environment, or None (and why) without one."""
    if os.environ.get("DTR_BUILD_NATIVE", "1") == "0":
        return None, "DTR_BUILD_NATIVE=0"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None, "torch is not importable in the build environment (use --no-build-isolation)"
    return Extension(
        "dtr._native",
        ["csrc/native/fastpath.cpp"],
        depends=["csrc/core_api.h", "csrc/depth_pool.h"],
        include_dirs=["csrc", *cpp_extension.include_paths()],
        library_dirs=cpp_extension.library_paths(),
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        runtime_library_dirs=cpp_extension.library_paths(),
        define_macros=[("DTR_TORCH_VERSION", f'"{torch.__version__}"'),
                       ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))],
        extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden"],
        language="c++",
    ), None


class _BuildExt(build_ext):
    """Builds every extension; a failure of the optional ``dtr._native`` only warns."""

    def build_extension(self, ext):
        if ext.name != "dtr._native":
            return super().build_extension(ext)
        try:
            super().build_extension(ext)
        except Exception as e:  # (a compiler error is a CompileError, a link error a LinkError)
            print(f"warning: dtr._native was not built ({e}); dtr runs its Python per-op path", file=sys.stderr)


native, why = _native_extension()
if native is not None:
    ext_modules.append(native)
else:
    print(f"note: dtr._native is not built: {why}", file=sys.stderr)

setup(ext_modules=ext_modules, cmdclass={"build_ext": _BuildExt})
