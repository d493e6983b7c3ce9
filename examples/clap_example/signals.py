"""SIGINT/SIGTERM during training: the first finishes the step, saves a checkpoint and prints
the resume command; a second stops at once, without saving, saying where a resume restarts."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[1] / "finetune_ced_sonar.py"


class StopSignals:
    """Remembers the first SIGINT/SIGTERM; ``restart_point()`` says where a resume would
    restart (for the second signal's message)."""

    def __init__(self, is_main: bool, restart_point: Callable[[], str]) -> None:
        self.is_main = is_main
        self.restart_point = restart_point
        self.signum: int | None = None

    def agreed(self, world: int, device: Any) -> int:
        """The signal every rank acts on (0: none): one rank's signal stops them all at the
        same step."""
        flag = torch.tensor(float(self.signum or 0))
        if world > 1:
            flag = flag.to(device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def handler(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # second signal: no more waiting
            if self.is_main:
                print(
                    f"[{name}] second signal: stopping now, without saving; a resume "
                    f"(--resume auto) restarts from {self.restart_point()}",
                    flush=True,
                )
            raise SystemExit(128 + signum)
        self.signum = signum
        if self.is_main:
            print(
                f"[{name}] saving a checkpoint after this step ... "
                "(send it again to stop at once, without saving)",
                flush=True,
            )

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handler) for sig in sigs}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def resume_command(argv: Sequence[str] | None, args: argparse.Namespace, world: int) -> str:
    """The command line of this run with ``--resume auto`` (and no ``--overwrite``)."""
    if argv is None:
        script, argv = sys.argv[0], list(sys.argv[1:])
    else:
        script = str(SCRIPT)
        argv = list(argv)
    kept: list[str] = []
    skip_value = False
    for i, token in enumerate(argv):
        if skip_value:
            skip_value = False
            continue
        if token in ("--resume", "--overwrite") or token.startswith(("--resume=", "--overwrite=")):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            skip_value = "=" not in token and (token == "--resume" or not nxt.startswith("-"))
            skip_value = skip_value and bool(nxt)
            continue
        kept.append(token)
    kept += ["--resume", "auto"]
    if args.overwrite:  # set in the config file
        kept += ["--overwrite", "false"]
    launcher = [sys.executable]
    if world > 1:
        launcher = ["torchrun", f"--nproc_per_node={world}"]
    return shlex.join([*launcher, script, *kept])
