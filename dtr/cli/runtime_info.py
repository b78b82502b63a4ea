"""``python -m dtr``: what the runtime runs here, and building its native per-op path.

``python -m dtr info`` prints dtr's and torch's versions, whether ``dtr._native``
is active for the running torch (where it comes from, or why not and the one
command that fixes it), the entry per device, and the compiler a build on first
use would run, as blocks here would run them: ``$DTR_NATIVE`` and ``$DTR_ENTRY``
count. It exits 0 when blocks run the native path, 1 when they do not, 2 when
one of those variables has a value blocks refuse or its output cannot be written.
``python -m dtr build`` builds it against the running torch, once (Note [Building
the native path on first use] in dtr/runtime/native_build.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from typing import Callable, List, Optional

import dtr

__all__ = ["main"]


def _compiler_line(cxx: Optional[List[str]]) -> str:
    if cxx is None:
        return "none found (set $CXX, or install g++ or clang++)"
    try:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    first = out.splitlines()[0] if out else "version unknown"
    return f"{' '.join(cxx)} ({first})"


def _report() -> dict:
    """What ``info`` says, as data."""
    out: dict = {"dtr": dtr.__version__, "python": platform.python_version()}
    try:
        import torch
    except ImportError:
        out.update(torch=None, native={"active": False, "why": "torch is not installed",
                                       "fix": "pip install torch"})
        return out
    from dtr.runtime import native, native_build

    st = native.status()
    kinds = ["cpu"]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():  # (does not initialize the device)
        kinds.append(accelerator.current_accelerator().type)
    if st.active:  # ($DTR_NATIVE, $DTR_ENTRY: ValueError for a value blocks refuse)
        chosen = native.use_native(None)
        devices = {k: native.use_entry(None, chosen, torch.device(k)) for k in kinds}
    else:  # (without it every block is a mode; asking use_native here would build it on first use)
        chosen = False
        entry = os.environ.get(native.ENTRY_ENV_VAR, "").strip().lower()
        if entry and entry not in native.ENTRIES:
            native.use_entry(entry)  # (raises the ValueError blocks raise)
        devices = {k: "mode" for k in kinds}
    used = dict(st._asdict(), built=st.active, active=chosen)
    if st.active and not chosen:
        used["why"] = f"{native.ENV_VAR}={os.environ.get(native.ENV_VAR, '')!r} turns it off"
        used["fix"] = f"unset {native.ENV_VAR}"
    try:
        compiler = _compiler_line(native_build.compiler())
    except native_build.NativeBuildError as e:  # ($CXX is not a command line: the message names it)
        compiler = f"unusable: {e}"
    out.update(torch=torch.__version__, cxx11_abi=int(torch._C._GLIBCXX_USE_CXX11_ABI),
               native=used, entries=devices, compiler=compiler,
               cache=str(native_build.cache_dir()), sources=str(native_build.source_dir()),
               builds_allowed=native_build.build_allowed())
    return out


def _print_info(r: dict) -> None:
    n = r["native"]
    print(f"dtr        {r['dtr']} (Python {r['python']})")
    if r["torch"] is None:
        print("torch      not installed: the runtime (dtr.budget) needs it; the simulator (dtr-sim) does not")
        return
    print(f"torch      {r['torch']} (C++11 ABI {r['cxx11_abi']})")
    if n["active"]:
        print(f"native     active: dtr._native {n['origin']} ({n['path']})")
    elif n["built"]:
        print(f"native     OFF: dtr._native {n['origin']} ({n['path']}), but blocks run the Python reference")
        print(f"           why: {n['why']}")
        print(f"           fix: {n['fix']}")
    else:
        print("native     MISSING: the runtime runs its Python reference (same results, more host time per op)")
        print(f"           why: {n['why']}")
        print(f"           fix: {n['fix']}")
    names = {"key": "key (a C++ dispatch key)", "mode": "mode (a TorchDispatchMode)"}
    print("entry      " + "; ".join(f"{d}: {names[e]}" for d, e in r["entries"].items()))
    print(f"compiler   {r['compiler']}")
    print(f"cache      {r['cache']}{'' if r['builds_allowed'] else ' (builds turned off: DTR_BUILD_NATIVE=0)'}")


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``python -m dtr``.

    Args:
        argv: the arguments after the program name; default ``sys.argv[1:]``.

    Returns:
        0 when blocks run the native path (``info``) or it was built (``build``), 1 when not; 2 for bad
        arguments, an output that cannot be written, or (``info``) a ``$DTR_NATIVE`` or ``$DTR_ENTRY`` that
        blocks refuse.
    """
    p = argparse.ArgumentParser(prog="python -m dtr", description="dtr's runtime here: what is active, and "
                                "building its native per-op path.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="versions, the native per-op path, the entry per device, the compiler")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    sub.add_parser("build", help="build the native per-op path against the running torch (once; cached)")
    args = p.parse_args(argv)
    if args.command == "info":
        try:
            r = _report()
        except ValueError as e:  # ($DTR_NATIVE or $DTR_ENTRY: the message names it and the valid values)
            print(f"python -m dtr: error: {e}", file=sys.stderr)
            return 2
        status = 0 if r["native"]["active"] else 1
        return _written(lambda: print(json.dumps(r, indent=2)) if args.json else _print_info(r), status)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("python -m dtr: error: torch is not installed: pip install torch", file=sys.stderr)
        return 1
    from dtr.runtime import native, native_build

    st = native.status()
    if st.active:
        return _written(lambda: print(f"dtr._native is active already: {st.origin} ({st.path})"), 0)
    try:
        path = native_build.build()
    except native_build.NativeBuildError as e:
        print(f"python -m dtr: error: {e}", file=sys.stderr)
        return 1
    return _written(lambda: print(f"built {path}"), 0 if native.status().active else 1)


def _written(write: Callable[[], None], status: int) -> int:
    """Run ``write``, which prints to stdout, and flush it: ``status``, or 2 after one line on stderr when stdout
    cannot be written (a full disk, ``> /dev/full``). A reader that closed the pipe (``| head -1``) is no error."""
    try:
        write()
        sys.stdout.flush()
    except OSError as e:
        try:  # (Python flushes stdout again on exit: what is left goes to /dev/null, not to a second error)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        if isinstance(e, BrokenPipeError):
            return status
        print(f"python -m dtr: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2
    return status
