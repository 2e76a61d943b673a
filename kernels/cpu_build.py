"""Compile a C source shipped with the package into a shared library, once per machine.

The CPU kernels (``kernels/csrc``) are plain C with OpenMP, built with the system's C
compiler the first time they are needed and cached, keyed by the source and the headers
beside it (``kernels/csrc/*.h``, code shared between libraries), the compiler, the flags and
the processor (``-march=native`` code must not run on another CPU model). The
build is atomic (compile to a temporary name, then rename), so concurrent processes are
safe. No compiler, or a failed build, means ``None``: callers fall back to PyTorch.

    TOLLWAY_CPU_KERNELS=reference   never build or load native kernels
    CC=clang                        the compiler to use (default: cc, then gcc)
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DISABLE_ENV = "TOLLWAY_CPU_KERNELS"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11")
# Linked apart from the compile and without -ffast-math: with it the compiler links
# crtfastmath.o, whose constructor sets flush-to-zero and denormals-are-zero for the whole
# process when the library is loaded, changing every other float computation in it.
LINK_FLAGS = ("-shared", "-fopenmp")
_BUILD_TIMEOUT_S = 120


def native_kernels_enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "native").strip().lower() != "reference"


def find_compiler() -> str | None:
    configured = os.environ.get("CC")
    if configured:
        return shutil.which(configured) or configured
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "tollway" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"tollway-kernels-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def cpu_fingerprint() -> str:
    """The processor model and its feature flags (what ``-march=native`` compiles for)."""
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    lines.append(line.strip())
                if line.strip() == "":
                    break  # the first processor describes them all
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), *lines])


def build_shared_library(source: Path) -> Path | None:
    """The path of ``source`` compiled to a shared library, or ``None`` if it cannot be built."""
    compiler = find_compiler()
    if compiler is None:
        logger.info("no C compiler found; CPU kernels fall back to PyTorch")
        return None
    key = hashlib.sha256()
    flags = " ".join((*COMPILE_FLAGS, "|", *LINK_FLAGS))
    headers = [path.read_bytes() for path in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, compiler.encode(), flags.encode()):
        key.update(part)
        key.update(b"\0")
    key.update(cpu_fingerprint().encode())
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    objects = partial.with_suffix(".o")
    steps = (
        [compiler, *COMPILE_FLAGS, "-c", "-o", str(objects), str(source)],
        [compiler, *LINK_FLAGS, "-o", str(partial), str(objects), "-lm"],
    )
    try:
        for command in steps:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
            )
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                logger.warning(
                    "building %s failed; CPU kernels fall back to PyTorch:\n%s",
                    source.name,
                    result.stderr.strip()[-2000:],
                )
                return None
    except (OSError, subprocess.TimeoutExpired) as error:
        partial.unlink(missing_ok=True)
        logger.warning("building %s failed (%s); CPU kernels fall back to PyTorch", source, error)
        return None
    finally:
        objects.unlink(missing_ok=True)
    os.replace(partial, target)
    return target


def load_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """``source`` built (if need be) and loaded, or ``None`` when native kernels are off or it
    cannot be built or loaded; ``fallback`` names what runs instead, for the log."""
    if not native_kernels_enabled():
        return None
    path = build_shared_library(source)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        logger.warning("loading %s failed (%s); %s", path, error, fallback)
        return None


def load_kernels(
    source: Path,
    fallback: str,
    abi: tuple[str, int],
    functions: Mapping[str, tuple[Sequence[Any], Any]],
) -> ctypes.CDLL | None:
    """``source``'s library (see :func:`load_library`) once its ABI function (``abi``: name,
    expected value) agrees, with each of ``functions`` (name: argtypes, restype) declared;
    ``None`` otherwise."""
    library = load_library(source, fallback)
    if library is None:
        return None
    abi_function, version = abi
    if getattr(library, abi_function)() != version:
        logger.warning("%s has an unexpected ABI version; %s", source.name, fallback)
        return None
    for name, (argtypes, restype) in functions.items():
        function = getattr(library, name)
        function.argtypes = list(argtypes)
        function.restype = restype
    return library
