"""Building ``dtr._native`` against the running torch, once, into a cache: for installs that did not build it.

Note [Building the native path on first use]
``dtr._native`` is C++ compiled against one torch's headers and libraries, and
torch promises no ABI across releases: a module built against 2.13.0 must not
load into 2.14. Three install routes can miss it: a wheel installed next to
another torch than it was built with, a build with no torch in sight, and a
torch upgraded after the install. The ecosystem's answers are a build that
finds the user's torch (setup.py does, even in pip's isolated build
environment: Note [Finding the user's torch] there), a one-time build on first
use against the running torch, cached by torch version and ABI (what
``torch.utils.cpp_extension.load`` does, as DeepSpeed's ops do), or torch's
stable C ABI, which does not cover the dispatcher, autograd and Python-object
internals this module uses. dtr does the first two: setup.py builds it where it
can, and where the installed module is missing or was built against another
torch, the first use (``dtr.budget``, or ``python -m dtr build`` ahead of
time) compiles the sources shipped inside the package (``dtr/_csrc``) with the
system's C++ compiler into a cache directory keyed by everything the binary
depends on: dtr's version and sources, torch's version and C++ ABI, the Python
extension suffix, the compiler. It says so before and after, once (logging,
at WARNING: the build takes a minute or two), and a lock file keeps two
processes from building the same key at once. No ninja is needed: it is one
compiler command, as setup.py runs it. Without a compiler, the runtime runs
its Python reference and ``python -m dtr info`` says what to install.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import List, Optional

import torch

from dtr import __version__
from dtr.errors import DtrError

__all__ = ["NativeBuildError", "CACHE_ENV_VAR", "BUILD_ENV_VAR", "build", "cache_dir", "compiler", "built_path",
           "load", "source_files", "source_dir", "build_allowed"]

log = logging.getLogger("dtr.native")

CACHE_ENV_VAR = "DTR_CACHE_DIR"     # where builds on first use go (default: $XDG_CACHE_HOME/dtr or ~/.cache/dtr)
BUILD_ENV_VAR = "DTR_BUILD_NATIVE"  # 0: never build dtr._native (neither setup.py nor on first use)
_FLAGS = ["-O2", "-g0", "-std=c++20", "-fvisibility=hidden", "-fPIC", "-shared"]
_LIBS = ["c10", "torch", "torch_cpu", "torch_python"]


class NativeBuildError(DtrError, RuntimeError):
    """Building ``dtr._native`` on first use failed (no compiler, no sources, or the compiler's error)."""


def build_allowed() -> bool:
    """Whether a build of dtr._native may run (``$DTR_BUILD_NATIVE`` is not 0)."""
    return os.environ.get(BUILD_ENV_VAR, "1").strip() != "0"


def source_dir() -> Optional[Path]:
    """The C++ sources: the installed package's ``dtr/_csrc``, or a checkout's ``csrc`` (None: neither)."""
    package = Path(__file__).resolve().parent.parent
    for d in (package / "_csrc", package.parent / "csrc"):
        if (d / "native" / "fastpath.cpp").is_file() and (d / "core_api.h").is_file():
            return d
    return None


def source_files(src: Path) -> List[Path]:
    """What dtr._native is compiled from (its .cpp files) and includes (the headers it needs), in a fixed order."""
    native = sorted((src / "native").glob("*.cpp")) + sorted((src / "native").glob("*.h"))
    return native + [src / "core_api.h", src / "depth_pool.h"]


def compiler() -> Optional[List[str]]:
    """The C++ compiler command: ``$CXX``, else the first of c++, g++, clang++ on the PATH (None: none, or
    ``$CXX`` names no program).

    Raises:
        NativeBuildError: ``$CXX`` is not a command line (an unbalanced quote); the message names it.
    """
    cxx = os.environ.get("CXX")
    if cxx:
        try:
            cmd = shlex.split(cxx)
        except ValueError as e:
            raise NativeBuildError(f"$CXX={cxx!r} is not a command line ({e}): set CXX to a compiler "
                                   "command, such as g++, or unset it") from None
        return cmd if cmd and shutil.which(cmd[0]) else None
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def cache_dir() -> Path:
    """Where builds on first use are kept: ``$DTR_CACHE_DIR``, else ``$XDG_CACHE_HOME/dtr``, else ``~/.cache/dtr``."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtr"


def _torch_defines() -> List[str]:
    return [f'-DDTR_TORCH_VERSION="{torch.__version__}"',
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _command(cxx: List[str], src: Path, out: Path) -> List[str]:
    from torch.utils import cpp_extension  # (imports setuptools: only when a build runs)

    includes = [src, *map(Path, cpp_extension.include_paths()), Path(sysconfig.get_paths()["include"])]
    libdirs = cpp_extension.library_paths()
    sources = [str(p) for p in source_files(src) if p.suffix == ".cpp"]
    link = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    return [*cxx, *_FLAGS, *_torch_defines(), *[f"-I{p}" for p in includes], *sources, "-o", str(out),
            *[f"-L{p}" for p in libdirs], *[f"-Wl,-rpath,{p}" for p in libdirs], *[f"-l{lib}" for lib in _LIBS],
            *link]


def _key(cxx: List[str], src: Path) -> str:
    """Everything the binary depends on, hashed: sources, flags, torch, the ABI, Python's suffix, the compiler."""
    h = hashlib.sha256()
    for part in (__version__, torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 sysconfig.get_config_var("EXT_SUFFIX") or "", sys.platform, " ".join(cxx), " ".join(_FLAGS),
                 " ".join(_torch_defines())):
        h.update(part.encode() + b"\0")
    for p in source_files(src):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return f"torch-{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


def built_path() -> Optional[Path]:
    """Where the build on first use for the running torch is (or would be); None without sources or a compiler.

    Raises:
        NativeBuildError: ``$CXX`` is not a command line (see :func:`compiler`).
    """
    cxx, src = compiler(), source_dir()
    if cxx is None or src is None:
        return None
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_dir() / _key(cxx, src) / f"_native{suffix}"


def build() -> Path:
    """Compile dtr._native against the running torch into the cache, unless it is there; its path.

    Says what it does before and after (logging, WARNING), once per build.

    Raises:
        NativeBuildError: no sources, no compiler (or a ``$CXX`` that is not a command line), builds turned off,
            a cache that cannot be created or written (the message names the path), or the compiler failed (the
            message ends with its output) or wrote no module.
    """
    if not build_allowed():
        raise NativeBuildError(f"building dtr._native is turned off (${BUILD_ENV_VAR}=0)")
    src, cxx = source_dir(), compiler()
    if src is None:
        raise NativeBuildError("the C++ sources of dtr._native are not installed with dtr (dtr/_csrc); reinstall "
                               "dtr from its source distribution or a checkout")
    if cxx is None:
        raise NativeBuildError("no C++ compiler found (set $CXX, or install g++ or clang++)")
    out = built_path()
    assert out is not None
    if out.is_file():
        return out
    try:
        return _build_into(out, cxx, src)
    except OSError as e:  # (the cache cannot be created or written: a file in the way, no permission, ...)
        where = os.fspath(e.filename) if e.filename is not None else str(out.parent)
        raise NativeBuildError(f"cannot write the build cache: {where}: {e.strerror or e} (set ${CACHE_ENV_VAR} "
                               "to a directory dtr can create and write)") from None


def _build_into(out: Path, cxx: List[str], src: Path) -> Path:
    """:func:`build`'s work once its inputs are known: compile into ``out`` under a lock, unless another process
    did. OSError: the cache cannot be written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "w") as lock:
        _lock(lock)
        if out.is_file():  # another process built it while this one waited
            return out
        log.warning("dtr: building the native per-op path (dtr._native) against torch %s with %s, once; "
                    "it takes a minute or two. Cached in %s", torch.__version__, cxx[0], out.parent)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            partial = Path(tmp) / out.name
            cmd = _command(cxx, src, partial)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:  # (not the cache's fault: the compiler cannot be run)
                raise NativeBuildError(f"cannot run the compiler {cxx[0]}: {e.strerror or e}") from None
            if p.returncode != 0:
                raise NativeBuildError(f"compiling dtr._native failed ({shlex.join(cmd[:2])} ...):\n"
                                       f"{(p.stdout + p.stderr)[-4000:]}")
            if not partial.is_file():
                raise NativeBuildError(f"compiling dtr._native with {shlex.join(cxx)} wrote no module (it exited 0 "
                                       f"but made no {partial.name}): is $CXX a C++ compiler?")
            os.replace(partial, out)  # (atomic: a reader sees no half-written module)
        log.warning("dtr: built dtr._native in %.0f s (%s)", time.perf_counter() - start, out)
    return out


def _lock(f) -> None:
    try:
        import fcntl
    except ImportError:  # (not POSIX: no lock; the rename keeps a reader safe)
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def load(path: Path) -> ModuleType:
    """Import the module at ``path`` as ``dtr._native``.

    Raises:
        ImportError: it cannot be loaded.
    """
    spec = importlib.util.spec_from_file_location("dtr._native", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["dtr._native"] = module
    return module
