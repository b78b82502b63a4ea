"""Build the C++ core ``dtr._C`` (pybind11); all metadata lives in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "dtr._C",
        [
            # The core (core.h), one file per subsystem.
            "csrc/core_graph.cpp", "csrc/core_materialize.cpp", "csrc/core_evict.cpp", "csrc/core_eqclass.cpp",
            "csrc/core_compact.cpp", "csrc/core_check.cpp",
            # Logs (program.h) and their replay (replay.h), and the Python module.
            "csrc/logparse.cpp", "csrc/replay.cpp", "csrc/bindings.cpp",
        ],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
