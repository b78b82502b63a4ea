"""Build the C++ core ``dtr._C`` (pybind11, torch-free) and the native per-op path ``dtr._native`` (against the
torch the package is installed next to); all metadata lives in pyproject.toml.

Note [Finding the user's torch]
``dtr._native`` must be compiled against the torch that will run it. ``pip install .`` builds in an isolated
environment without that torch (pip's default build isolation), and asking for torch in
``build-system.requires`` would fetch a torch of pip's choosing (gigabytes of CUDA build, perhaps another
release). So the build asks the interpreter that runs it, in isolated mode (``python -I``: without the build
environment's paths), where its torch is: that is the environment pip installs into, and the torch the user
runs. Its headers and libraries are enough to compile against; nothing is imported into the build. Where no
torch is found, or ``DTR_BUILD_NATIVE=0``, or the compiler fails, the build goes on without ``dtr._native``;
the runtime then builds it on first use against the running torch (Note [Building the native path on first
use] in dtr/runtime/native_build.py), from the sources this build ships inside the package (``dtr/_csrc``).
Next to the module goes ``_native_build.json``, the torch it was built against, which the runtime reads
before importing it (a module built against another torch must not be loaded at all).
"""
import json
import os
import shutil
import subprocess
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# The C++ sources the runtime can build dtr._native from on first use (shipped as dtr/_csrc).
NATIVE_SOURCES = ["native/fastpath.cpp", "native/table.cpp", "native/liveness.cpp",
                  "native/prediction.cpp", "native/dispatch.cpp", "native/commit.cpp", "native/module.cpp",
                  "native/twins.cpp"]
NATIVE_HEADERS = ["core_api.h", "depth_pool.h", "native/py_object.h", "native/fastpath.h"]

ext_modules = [
    Pybind11Extension(
        "dtr._C",
        [
            # The core (core.h), one file per subsystem.
            "csrc/core_graph.cpp", "csrc/core_materialize.cpp", "csrc/core_evict.cpp", "csrc/core_eqclass.cpp",
            "csrc/core_compact.cpp", "csrc/core_check.cpp", "csrc/core_follow.cpp",
            # Logs (program.h) and their replay (replay.h), and the Python module.
            "csrc/logparse.cpp", "csrc/replay.cpp", "csrc/bindings.cpp",
            # The FastSA planner's annealing loop (dtr/sim/planners/fastsa.py).
            "csrc/fastsa.cpp",
        ],
        depends=["csrc/core.h", "csrc/core_internal.h", "csrc/core_api.h", "csrc/depth_pool.h", "csrc/program.h",
                 "csrc/log_json.h", "csrc/replay.h", "csrc/fastsa.h"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]

_TORCH_PROBE = """
import json, torch
from torch.utils import cpp_extension
print(json.dumps({"version": torch.__version__, "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "include": cpp_extension.include_paths(), "lib": cpp_extension.library_paths()}))
"""


def _user_torch():
    """(the torch to build against as a dict, or None, and where it was found or why not)."""
    try:  # torch in the build environment itself (--no-build-isolation, make)
        import torch  # noqa: F401
        from torch.utils import cpp_extension
        return ({"version": torch.__version__, "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                 "include": cpp_extension.include_paths(), "lib": cpp_extension.library_paths()},
                "the build environment")
    except ImportError:
        pass
    try:  # see Note [Finding the user's torch]
        p = subprocess.run([sys.executable, "-I", "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"asking {sys.executable} for its torch failed ({e})"
    if p.returncode != 0:
        return None, f"torch is not installed next to {sys.executable}"
    return json.loads(p.stdout.strip().splitlines()[-1]), f"{sys.executable}'s environment"


def _native_extension():
    """``dtr._native`` against the user's torch, or None (and why) without one."""
    if os.environ.get("DTR_BUILD_NATIVE", "1") == "0":
        return None, "DTR_BUILD_NATIVE=0", None
    torch_info, where = _user_torch()
    if torch_info is None:
        return None, where, None
    return Extension(
        "dtr._native",
        ["csrc/" + s for s in NATIVE_SOURCES],
        depends=["csrc/" + h for h in NATIVE_HEADERS],
        include_dirs=["csrc", *torch_info["include"]],
        library_dirs=torch_info["lib"],
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        runtime_library_dirs=torch_info["lib"],
        define_macros=[("DTR_TORCH_VERSION", f'"{torch_info["version"]}"'),
                       ("_GLIBCXX_USE_CXX11_ABI", str(torch_info["abi"]))],
        extra_compile_args=["-O2", "-g0", "-std=c++20", "-fvisibility=hidden"],
        language="c++",
    ), where, torch_info


class _BuildExt(build_ext):
    """Builds every extension; a failure of the optional ``dtr._native`` only warns. Next to a built
    ``dtr._native`` it writes ``_native_build.json`` (see Note [Finding the user's torch])."""

    def build_extension(self, ext):
        if ext.name != "dtr._native":
            return super().build_extension(ext)
        try:
            super().build_extension(ext)
        except Exception as e:  # (a compiler error is a CompileError, a link error a LinkError)
            print(f"warning: dtr._native was not built ({e}); dtr builds it on first use, or runs its Python "
                  f"per-op path", file=sys.stderr)
            self.native_failed = True

    def run(self):
        self.native_failed = False
        super().run()
        if native is None:
            return
        path = self.get_ext_fullpath("dtr._native")  # (built now, or up to date from an earlier build)
        target = os.path.join(os.path.dirname(path), "_native_build.json")
        if self.native_failed or not os.path.exists(path):
            if os.path.exists(target):
                os.remove(target)  # (no record of a module that is not there)
            return
        with open(target, "w") as f:
            json.dump({"torch": native_torch["version"], "cxx11_abi": native_torch["abi"]}, f)


class _BuildPy(build_py):
    """Ships the C++ sources of dtr._native inside the package (``dtr/_csrc``), for a build on first use."""

    def run(self):
        super().run()
        root = os.path.join(self.build_lib, "dtr", "_csrc")
        for rel in NATIVE_SOURCES + NATIVE_HEADERS:
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            shutil.copyfile(os.path.join("csrc", rel), os.path.join(root, rel))


native, why, native_torch = _native_extension()
if native is not None:
    ext_modules.append(native)
    print(f"note: building dtr._native against torch {native_torch['version']} from {why}", file=sys.stderr)
else:
    print(f"note: dtr._native is not built now ({why}); dtr builds it on first use", file=sys.stderr)

ParallelCompile("DTR_BUILD_JOBS", default=0).install()  # (the core's files in parallel: all cores by default)
setup(ext_modules=ext_modules, cmdclass={"build_ext": _BuildExt, "build_py": _BuildPy})
