"""Build the C++ core ``dtr._C`` (pybind11); all metadata lives in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "dtr._C",
        sorted(["csrc/core.cpp", "csrc/logparse.cpp", "csrc/replay.cpp", "csrc/bindings.cpp"]),
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
