"""The native per-op path on every install route (Note [Building the native path on first use] in
dtr/runtime/native_build.py, Note [Finding the user's torch] in setup.py), and ``python -m dtr info``.

``make check-install`` proves the ``pip install .`` route in a fresh environment; here: the module an install
built is used only for the torch it was built against, a build on first use happens once and says so, a
machine without a compiler runs the reference and says what to do, and ``python -m dtr`` reports it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import dtr

torch = pytest.importorskip("torch")
from support.paths import ROOT  # noqa: E402

from dtr.cli import runtime_info  # noqa: E402
from dtr.runtime import native, native_build  # noqa: E402


def test_info_reports_the_active_path_and_exits_0(monkeypatch, capsys):
    if not native.status().active:
        pytest.skip("dtr._native is not active in this environment")
    monkeypatch.delenv("DTR_NATIVE", raising=False)
    monkeypatch.delenv("DTR_ENTRY", raising=False)
    assert runtime_info.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"dtr        {dtr.__version__}" in out and f"torch      {torch.__version__}" in out
    assert "native     active: dtr._native" in out and "entry      cpu: key" in out
    assert runtime_info.main(["info", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["native"]["active"] and r["torch"] == torch.__version__ and r["entries"]["cpu"] == "key"


def test_info_says_what_blocks_run_under_the_environment_variables(monkeypatch, capsys):
    """$DTR_NATIVE and $DTR_ENTRY choose what a block runs: info says what blocks here would run, and refuses
    (exit 2) the values blocks refuse."""
    if not native.status().active:
        pytest.skip("dtr._native is not active in this environment")
    monkeypatch.delenv("DTR_ENTRY", raising=False)
    monkeypatch.setenv("DTR_NATIVE", "0")
    assert runtime_info.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "native     OFF" in out and "DTR_NATIVE='0' turns it off" in out and "entry      cpu: mode" in out
    monkeypatch.delenv("DTR_NATIVE")
    monkeypatch.setenv("DTR_ENTRY", "mode")
    assert runtime_info.main(["info"]) == 0
    assert "entry      cpu: mode" in capsys.readouterr().out
    for var, value in (("DTR_ENTRY", "bogus"), ("DTR_NATIVE", "maybe")):
        monkeypatch.delenv("DTR_ENTRY", raising=False)
        monkeypatch.setenv(var, value)
        assert runtime_info.main(["info"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m dtr: error:") and f"{value!r}" in err and "Traceback" not in err, err


def test_info_says_why_the_path_is_missing_and_what_fixes_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_installed", lambda: (None, "the install did not build dtr._native"))
    monkeypatch.setenv("DTR_CACHE_DIR", str(tmp_path))  # (no build on first use cached there)
    assert runtime_info.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "native     MISSING" in out
    assert "why: the install did not build dtr._native, and no build on first use is cached for torch" in out
    assert "fix: python -m dtr build" in out
    assert "entry      cpu: mode" in out  # (the key needs dtr._native)
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # no compiler: the fix says what to install
    monkeypatch.setattr(native, "_state", {})
    assert runtime_info.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "fix: install a C++ compiler (g++ or clang++, or set $CXX), then: python -m dtr build" in out
    assert "compiler   none found" in out


def test_an_install_built_for_another_torch_is_not_imported(monkeypatch, tmp_path):
    sidecar = tmp_path / "_native_build.json"
    monkeypatch.setattr(native, "SIDECAR", sidecar)
    assert native._installed() == (None, "the install did not build dtr._native")
    sidecar.write_text(json.dumps({"torch": "2.0.0", "cxx11_abi": 1}))
    got, why = native._installed()
    assert got is None and why == f"the installed dtr._native was built against torch 2.0.0, but torch " \
                                  f"{torch.__version__} runs"
    sidecar.write_text(json.dumps({"torch": torch.__version__, "cxx11_abi": 1 - torch._C._GLIBCXX_USE_CXX11_ABI}))
    assert "_GLIBCXX_USE_CXX11_ABI" in native._installed()[1]
    sidecar.write_text("{not json")
    assert "unreadable" in native._installed()[1]


def test_the_cache_key_follows_torch_the_sources_and_the_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("DTR_CACHE_DIR", str(tmp_path))
    if native_build.compiler() is None or native_build.source_dir() is None:
        pytest.skip("no compiler or no sources")
    first = native_build.built_path()
    assert first is not None and first.parent.parent == tmp_path
    assert first.parent.name.startswith(f"torch-{torch.__version__.replace('+', '_')}-")
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert native_build.built_path() != first
    monkeypatch.undo()
    monkeypatch.setenv("DTR_CACHE_DIR", str(tmp_path))
    assert native_build.built_path() == first  # (stable: the same inputs, the same place)
    monkeypatch.setenv("CXX", f"{native_build.compiler()[0]} -DNOTHING")
    assert native_build.built_path() != first


def test_builds_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DTR_BUILD_NATIVE", "0")
    with pytest.raises(native_build.NativeBuildError, match=r"turned off \(\$DTR_BUILD_NATIVE=0\)"):
        native_build.build()
    assert "turned off" in native._built_on_first_use("no install")[1]


_NO_COMPILER = textwrap.dedent('''
    import json, warnings
    import torch, dtr
    import dtr.runtime.native as n
    n._installed = lambda: (None, "the test ignores the installed dtr._native")
    x = torch.randn(64, 64)
    want = torch.tanh(x @ x).sum()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with dtr.budget(None, cost_model="flops") as b:
            got = torch.tanh(x @ x).sum()
    print(json.dumps({"native": b.native, "entry": b.entry, "exact": bool(torch.equal(got, want)),
                      "warnings": [str(w.message) for w in seen]}))
''')


@pytest.mark.slow
def test_without_a_compiler_the_reference_runs_and_says_what_to_do(tmp_path):
    env = {"PATH": "/nonexistent", "CXX": "", "DTR_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _NO_COMPILER], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert not r["native"] and r["entry"] == "mode" and r["exact"]
    (w,) = [w for w in r["warnings"] if "native per-op path is unavailable" in w]
    assert "no C++ compiler found" in w and "python -m dtr info" in w and "python -m dtr build" in w


_FIRST_USE = textwrap.dedent('''
    import json
    import torch, dtr
    import dtr.runtime.native as n
    n._installed = lambda: (None, "the test ignores the installed dtr._native")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    x = torch.randn(256, 128)
    model(x).square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with dtr.budget(None, cost_model="flops") as probe:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    with dtr.budget(int(0.7 * probe.stats["peak_bytes"]), cost_model="flops") as b:
        model(x).square().mean().backward()
    print(json.dumps({"native": b.native, "entry": b.entry, "origin": n._state.get("origin"),
                      "remats": b.stats["remats"],
                      "exact": all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))}))
''')


@pytest.mark.slow
def test_a_build_on_first_use_happens_once_and_says_so(tmp_path):
    """The route of a wheel installed next to another torch, or of an install that found no torch."""
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler")
    env = {**__import__("os").environ, "DTR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _FIRST_USE], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append((json.loads(p.stdout.strip().splitlines()[-1]), p.stderr))
    (first, first_err), (second, second_err) = runs
    for r in (first, second):
        assert r["native"] and r["entry"] == "key" and r["origin"] == "built on first use"
        assert r["exact"] and r["remats"] > 0
    assert "dtr: building the native per-op path (dtr._native) against torch" in first_err
    assert "dtr: built dtr._native in" in first_err
    assert "building" not in second_err  # (cached: once per torch)
    assert len(list(tmp_path.glob("torch-*/_native*"))) == 1


def test_a_cxx_that_is_not_a_command_line_is_named(monkeypatch, capsys, tmp_path):
    """A $CXX with an unbalanced quote: blocks run the reference (why names it), info and build say so."""
    monkeypatch.setenv("CXX", 'g++ "')
    monkeypatch.setenv("DTR_CACHE_DIR", str(tmp_path))
    words = "$CXX='g++ \"' is not a command line (No closing quotation)"
    with pytest.raises(native_build.NativeBuildError) as e:
        native_build.compiler()
    assert words in str(e.value)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_installed", lambda: (None, "the install did not build dtr._native"))
    assert native.native_module() is None and words in native._state["why"]  # (a block warns with it)
    monkeypatch.setattr(native, "_state", {})
    assert runtime_info.main(["info"]) == 1
    out = capsys.readouterr().out
    assert f"compiler   unusable: {words}" in out and "fix: set $CXX to a compiler command" in out
    assert runtime_info.main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m dtr: error: ") and words in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("cache,cxx", [("file", None), ("file/below", None), ("cache", "true")])
def test_a_build_that_cannot_write_its_module_says_where(monkeypatch, capsys, tmp_path, cache, cxx):
    """A cache that cannot be created (a file in the way), or a $CXX that exits 0 and writes nothing: one line,
    status 1 (a traceback from mkdir or os.replace)."""
    if native_build.source_dir() is None or native_build.compiler() is None:
        pytest.skip("no sources or no compiler")
    if cxx is not None:
        if __import__("shutil").which(cxx) is None:
            pytest.skip(f"no {cxx} command")
        monkeypatch.setenv("CXX", cxx)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DTR_CACHE_DIR", str(tmp_path / cache))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_installed", lambda: (None, "the install did not build dtr._native"))
    assert runtime_info.main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m dtr: error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (f"cannot write the build cache: {tmp_path / cache}" in err if cxx is None
            else "compiling dtr._native with true wrote no module" in err), err


@pytest.mark.parametrize("argv", [["info"], ["info", "--json"]])
def test_info_into_a_full_disk_says_so_in_one_line(argv):
    """``python -m dtr info > /dev/full``: status 2 and one line on stderr (an OSError traceback)."""
    if not __import__("os").path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "dtr", *argv], stdout=full, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, timeout=300)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "python -m dtr: error: cannot write the output: No space left on device"], p.stderr
