"""Building C sources into cached shared libraries, and failing soft."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import cpu_build
from kernels.cpu_build import build_shared_library, find_compiler

SOURCE = "int tollway_answer(void) { return 42; }\n"


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tollway" / "kernels"


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_builds_once_and_reuses_the_cached_library(tmp_path: Path, cache_home: Path) -> None:
    import ctypes

    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    first = build_shared_library(source)
    assert first is not None
    assert first.parent == cache_home
    assert ctypes.CDLL(str(first)).tollway_answer() == 42
    built_at = first.stat().st_mtime_ns
    assert build_shared_library(source) == first
    assert first.stat().st_mtime_ns == built_at  # not rebuilt
    assert not list(cache_home.glob("*.partial"))

    source.write_text(SOURCE.replace("42", "43"))  # a changed source is a new library
    second = build_shared_library(source)
    assert second is not None
    assert second != first


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_a_changed_header_beside_the_source_is_a_new_library(
    tmp_path: Path, cache_home: Path
) -> None:
    import ctypes

    (tmp_path / "answer.h").write_text("#define ANSWER 42\n")
    source = tmp_path / "answer.c"
    source.write_text('#include "answer.h"\nint tollway_answer(void) { return ANSWER; }\n')
    first = build_shared_library(source)
    (tmp_path / "answer.h").write_text("#define ANSWER 43\n")
    second = build_shared_library(source)
    assert first is not None
    assert second is not None
    assert second != first
    assert ctypes.CDLL(str(second)).tollway_answer() == 43


def test_a_failed_build_returns_none_and_leaves_nothing(
    tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    if find_compiler() is not None:
        assert build_shared_library(source) is None
        assert not list(cache_home.glob("*"))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert build_shared_library(source) is None


def test_no_compiler_returns_none(
    tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    assert build_shared_library(source) is None


def test_the_cache_key_names_the_processor() -> None:
    """``-march=native`` code is keyed by what it was compiled for: the CPU's feature flags."""
    import platform

    fingerprint = cpu_build.cpu_fingerprint()
    assert fingerprint.startswith(platform.machine())
    if Path("/proc/cpuinfo").is_file():
        flags = [
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("flags", "Features"))
        ]
        assert flags
        assert flags[0].strip() in fingerprint


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_load_library_loads_the_built_library_unless_disabled(
    tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    library = cpu_build.load_library(source, "the reference runs")
    assert library is not None
    assert library.tollway_answer() == 42
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "reference")
    assert cpu_build.load_library(source, "the reference runs") is None
    monkeypatch.delenv(cpu_build.DISABLE_ENV)
    (tmp_path / "broken.c").write_text("this is not C\n")
    assert cpu_build.load_library(tmp_path / "broken.c", "the reference runs") is None


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_load_kernels_checks_the_abi_and_declares_the_functions(
    tmp_path: Path, cache_home: Path
) -> None:
    import ctypes

    source = tmp_path / "kernel.c"
    source.write_text(
        SOURCE + "int tollway_abi(void) { return 3; }\n"
        "double tollway_half(double x) { return x / 2; }\n"
    )
    functions = {"tollway_half": ([ctypes.c_double], ctypes.c_double)}
    library = cpu_build.load_kernels(source, "the test falls back", ("tollway_abi", 3), functions)
    assert library is not None
    assert library.tollway_half(5) == 2.5  # declared: a double in, a double out
    assert cpu_build.load_kernels(source, "the test falls back", ("tollway_abi", 4), {}) is None


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_loading_the_kernels_leaves_the_process_float_mode_alone(cache_home: Path) -> None:
    # -ffast-math at link time adds crtfastmath.o, whose constructor turns on flush-to-zero
    # for the whole process: subnormal results would then read 0 everywhere, torch included.
    import subprocess
    import sys

    sources = sorted((Path(cpu_build.__file__).parent / "csrc").glob("*.c"))
    libraries = [build_shared_library(source) for source in sources]
    assert sources
    assert all(library is not None for library in libraries)
    check = (
        "import ctypes, sys\n"
        "for path in sys.argv[1:]: ctypes.CDLL(path)\n"
        "assert 2.2250738585072014e-308 / 4 > 0, 'subnormals flushed to zero'\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", check, *map(str, libraries)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
