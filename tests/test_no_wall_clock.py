"""No test asserts a wall-clock limit (issue 43): a slow minute on a loaded CI machine must
not fail a test. Speed is measured in ``benchmarks/``; what a test must show about time is
a bound that load cannot break: CPU seconds (``resource.getrusage``, ``time.process_time``),
bytes read, or an order ("fails before any data is written"). The few files under tests/
that read a wall clock are listed here with why each stays."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WALL_CLOCKS = re.compile(
    r"\b(?:time\.time|perf_counter|monotonic|time_ns|perf_counter_ns|monotonic_ns)\("
    r"|\bdatetime\.now\(|\btimeit\b"
)
# file (relative to tests/) -> why it reads a wall clock
ALLOWED = {
    "helpers.py": "spawn_ranks' deadline kills ranks that hang in a collective (300 s, "
    "against seconds when they work): a hang guard, not a claim about speed",
    "examples/kill_loop.py": "draws its SIGKILL moments within the reference run's "
    "duration and logs the seconds; it asserts nothing on them",
}


def test_only_the_listed_files_read_a_wall_clock() -> None:
    found = {
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("*.py")
        if path != Path(__file__).resolve() and WALL_CLOCKS.search(path.read_text("utf-8"))
    }
    assert found == set(ALLOWED), f"read a wall clock: {sorted(found)}; listed: {sorted(ALLOWED)}"


def test_the_pattern_finds_each_clock() -> None:
    for call in ("time.time()", "time.perf_counter()", "time.monotonic()", "perf_counter()",
                 "datetime.now()", "timeit.timeit(f)", "time.monotonic_ns()"):  # fmt: skip
        assert WALL_CLOCKS.search(f"x = {call}"), call
    for call in ("time.process_time()", "resource.getrusage(resource.RUSAGE_SELF)",
                 "def test_monotonic_in_k():"):  # fmt: skip
        assert not WALL_CLOCKS.search(call), call
