"""The native build (`ouro.native.build`) and the fused kernels' fallback: a source that does not
compile, or a machine without a compiler, gives the reason and the eager path, with one log line."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ouro.native.build import compile_native


def test_a_source_that_does_not_compile_gives_the_compilers_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OURO_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "broken.cpp"
    src.write_text("int f() { return undefined_name; }\n")     # no torch headers: the error, not 6 s of parsing
    built, why = compile_native("broken_test", src, python_module=False)
    assert built is None and "undefined_name" in why


@pytest.mark.processes
def test_a_lock_left_by_a_killed_build_does_not_stall_the_next_start(tmp_path):
    """torch's build lock file outlives a builder killed mid-build, and cpp_extension waits on it for
    ever: every later `ouro serve` hung at start (found on the Zen 3 class, a TP server after a killed
    one). A stale lock before the build and one after it: each next start builds or loads at once."""
    from ouro.native.build import build_key
    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int ouro_tiny_answer() { return 7; }\n')
    directory = tmp_path / "cache" / "ext" / f"tiny_{build_key([src])}"
    directory.mkdir(parents=True)
    code = ("import ctypes, sys; from pathlib import Path; from ouro.native.build import compile_native; "
            "lib, why = compile_native('tiny', Path(sys.argv[1]), python_module=False); "
            "print('ANSWER', why or ctypes.CDLL(lib).ouro_tiny_answer())")
    env = {**os.environ, "OURO_CACHE": str(tmp_path / "cache")}
    for stage in ("before the build", "after it"):
        (directory / "lock").touch()
        out = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=180,
                             env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert out.returncode == 0 and "ANSWER 7" in out.stdout, (stage, out.stdout, out.stderr[-2000:])
    assert (directory / "built").is_file()


@pytest.mark.processes
def test_no_compiler_falls_back_to_eager_with_one_log_line(tmp_path):
    """A fresh cache and a compiler that is not there: every family says why once, the model runs."""
    code = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
        from ouro.native import kernels
        from ouro.layers.norm import RMSNorm
        torch.set_grad_enabled(False)
        x = torch.randn(3, 8)
        assert not kernels.usable("norms", x) and not kernels.usable("norms", x)
        assert kernels.isa("norms") == "none"
        norm = RMSNorm(8, 1e-6)
        norm.weight.data = torch.randn(8)
        y = norm(x)
        ref = norm.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))
        assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
        print("WHY", kernels.why_not("norms"))
    """)
    env = {**os.environ, "OURO_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-compiler")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    logs = [line for line in text.splitlines() if line.startswith("LOG ") and "fused norms kernels" in line]
    assert len(logs) == 1, text[-2000:]
    assert "WHY" in text and "WHY None" not in text


@pytest.mark.processes
def test_ouro_fused_0_turns_every_family_off(tmp_path):
    code = ("import torch; from ouro.native import kernels; torch.set_grad_enabled(False); "
            "print(kernels.usable('norms', torch.ones(2)), kernels.why_not('norms'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OURO_FUSED": "0"}, capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "OURO_FUSED=0"]


@pytest.mark.parametrize("value, off", [("0", True), ("1", False), ("", False), (None, False), (" 0 ", True)])
def test_the_on_off_switches_read_0_and_1_only(monkeypatch, value, off):
    from ouro.machine_cache import switched_off
    if value is None:
        monkeypatch.delenv("OURO_FUSED", raising=False)
    else:
        monkeypatch.setenv("OURO_FUSED", value)
    assert switched_off("OURO_FUSED") is off


@pytest.mark.parametrize("value", ["false", "off", "no", "2"])
def test_an_unreadable_switch_is_refused_not_read_as_on(monkeypatch, value):
    """OURO_FUSED=false was read as "not 0": the fused kernels stayed on without a word."""
    from ouro.native import kernels
    monkeypatch.setenv("OURO_FUSED", value)
    with pytest.raises(ValueError, match=f"OURO_FUSED must be 0 \\(off\\) or 1 \\(on\\), got '{value}'"):
        kernels.load_all()
    monkeypatch.setenv("OURO_MALLOC_TUNE", value)
    from ouro.engine import host_allocator
    with pytest.raises(ValueError, match="OURO_MALLOC_TUNE must be 0"):
        host_allocator.why_not()


def test_fused_ops_are_one_call_in_a_compiled_graph():
    from ouro.native import norms
    torch.set_grad_enabled(False)
    try:
        x, w = torch.randn(4, 24), torch.randn(24)
        assert norms.can(x, w)
        f = torch.compile(lambda a, b: norms.rms_norm(a, b, 1e-6) * 2.0, fullgraph=True)
        ref = w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)) * 2.0
        got = f(x, w)
        assert float((got - ref).norm() / ref.norm()) <= 1e-6
    finally:
        torch.set_grad_enabled(True)


def test_every_family_source_is_listed():
    from pathlib import Path

    from ouro.native import kernels
    on_disk = {p.stem for p in Path(kernels.HERE).glob("*.cpp")}
    assert set(kernels.FAMILIES) == on_disk


@torch.no_grad()          # `usable` is False with autograd on
def test_eager_only_for_some_families_keeps_the_others_fused():
    import pytest

    from ouro.native import kernels
    x = torch.zeros(2)
    if not (kernels.load("mla") and kernels.load("norms")):
        pytest.skip("the native kernels cannot be built here")
    assert kernels.usable("mla", x) and kernels.usable("norms", x)
    with kernels.eager_only(families=("mla",)):
        assert not kernels.usable("mla", x) and kernels.usable("norms", x)
        assert not kernels.fused_off()        # merged products and the rest stay on
        with kernels.eager_only():
            assert not kernels.usable("norms", x)
    assert kernels.usable("mla", x) and kernels.usable("norms", x)
    with pytest.raises(ValueError, match="unknown kernel families"):
        with kernels.eager_only(families=("attention",)):
            pass


@pytest.mark.processes
def test_a_graph_traced_before_any_eager_step_holds_the_fused_ops(tmp_path):
    """A fresh process whose first forward is the compiled decode graph's warm-up: the graph loads
    every family before its trace (a build inside a trace fails it), and a trace that meets an
    unloaded family says what to call."""
    code = textwrap.dedent("""
        import torch
        from ouro.engine.decode_graph import DecodeGraph
        from ouro.engine.simple_runner import SimpleRunner
        from ouro.models.loader import load_model
        from ouro.models.resolve import resolve_model
        from ouro.native import kernels
        from ouro.layers.norm import RMSNorm
        torch.set_grad_enabled(False)
        norm = RMSNorm(8, 1e-6)
        try:
            torch.compile(norm, fullgraph=True, backend="eager")(torch.randn(2, 8))
        except Exception as e:
            print("REFUSED", "load_all()" in str(e))
        model = load_model(resolve_model("tiny"))
        runner = SimpleRunner(model, 2, 32)
        graph = DecodeGraph(model, runner.cache, 1, int(runner.page_table[1, 0]), max_bs=1, backend="eager")
        graph.warm_up(progress=False)
        print("LOADED", all(kernels.load(f) for f in kernels.FAMILIES))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED True" in out.stdout and "LOADED True" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_cache_reached_through_a_link_reuses_the_build(tmp_path, monkeypatch):
    """A fresh $OURO_CACHE whose `ext/` links the machine's (as the preset-cache tests do) finds the
    build done: the build file names the real directory, so it is neither rewritten nor rebuilt
    (it named the link once, and each side then rebuilt every family: two minutes of the suite)."""
    from ouro.native import kernels
    from ouro.machine_cache import cache_root
    assert kernels.load("norms")
    built, why = compile_native("fused_norms", kernels.HERE / "norms.cpp", kernels.HEADERS, python_module=False)
    assert why is None
    ninja = os.path.join(os.path.dirname(built), "build.ninja")
    before = (open(ninja, "rb").read(), os.stat(built).st_mtime_ns)
    (tmp_path / "ext").symlink_to((cache_root() / "ext").resolve())
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    again, why = compile_native("fused_norms", kernels.HERE / "norms.cpp", kernels.HEADERS, python_module=False)
    assert why is None and os.path.realpath(again) == os.path.realpath(built)
    assert (open(ninja, "rb").read(), os.stat(built).st_mtime_ns) == before


@pytest.mark.processes
def test_builds_side_by_side_leave_each_built_and_a_failing_one_to_its_caller(tmp_path, monkeypatch):
    """`build_side_by_side` builds what is not built yet in child processes; a source that does not
    compile is left unbuilt (the caller's own compile_native then gives its error), nothing raises."""
    from ouro.native.build import build_side_by_side, is_built
    monkeypatch.setenv("OURO_CACHE", str(tmp_path / "cache"))
    good = []
    for i in range(2):
        src = tmp_path / f"tiny{i}.cpp"
        src.write_text(f'extern "C" int ouro_tiny_answer() {{ return {i}; }}\n')
        good.append((f"tiny{i}", src, ()))
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f() { return undefined_name; }\n")
    build_side_by_side([*good, ("bad", bad, ())], workers=2)
    assert all(is_built(*b) for b in good) and not is_built("bad", bad)
    built, why = compile_native("bad", bad, python_module=False)
    assert built is None and "undefined_name" in why


def test_extra_build_flags_are_part_of_the_build_key(tmp_path, monkeypatch):
    """`OURO_NATIVE_CFLAGS` (e.g. -mno-avx512f for the AVX2 paths) builds apart from the default:
    a build keyed without its flags would load the other path's library."""
    from ouro.native import build
    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    monkeypatch.delenv(build.EXTRA_CFLAGS_ENV, raising=False)
    plain = build.build_key([src])
    monkeypatch.setenv(build.EXTRA_CFLAGS_ENV, "-mno-avx512f")
    assert build.cflags()[-1] == "-mno-avx512f" and build.build_key([src]) != plain


def test_fakes_register_when_the_families_load_before_their_modules():
    """`kernels.load_all()` (what a loader's error tells a caller to run before compiling) in a fresh
    interpreter before any layer imported `ouro.native.mhc`: the op still has its fake, so a compiled
    graph can hold it (a fake registered only at load time was never registered)."""
    code = textwrap.dedent("""
        import sys
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from ouro.native import kernels
        assert "ouro.native.mhc" not in sys.modules
        assert kernels.load_all()["mhc"]
        from ouro.native import mhc
        with FakeTensorMode():
            x, post, comb = mhc.hc_pre(torch.empty(3, 2, 8), torch.empty(8, 16), torch.empty(8), torch.empty(3),
                                       1e-6, 1e-6, 2)
        assert x.shape == (3, 8) and post.shape == (3, 2) and comb.shape == (3, 2, 2)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
