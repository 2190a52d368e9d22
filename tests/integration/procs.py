"""`staleflow` commands run as processes of their own, and never left running after a test.

Each runs in a process group of its own: a run's Ray and Redis (its children) go with it when
a test stops it. The autouse fixture in conftest.py stops whatever a test left running, also
when the test failed or pytest-timeout interrupted it, so a leftover run with its own Ray does
not take the shared cores from the tests after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar


class LoggedProcess(subprocess.Popen):
    """A process whose output goes to a file, not a pipe: a run logs a line per step, and a
    pipe holds 64 KiB, so a fast run a test was not reading yet blocked in a write (the
    scale test's run stopped at step ~297 of 400 that way, once its steps took 17 ms).
    `communicate` waits and returns the whole output, as with a pipe; past its timeout it
    stops the process and fails with the end of the output."""

    started: ClassVar[list[LoggedProcess]] = []

    def __init__(self, args: list[str], log: Path, **kwargs) -> None:
        self.log = log
        self._file = log.open("w")
        super().__init__(args, stdout=self._file, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, **kwargs)  # fmt: skip
        LoggedProcess.started.append(self)

    def communicate(self, input=None, timeout=None):
        try:
            self.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{' '.join(map(str, self.args))} did not finish in {timeout} s (stopped); its "
                f"output ends:\n{self.log.read_text()[-3000:]}"
            ) from None
        self._file.close()
        return self.log.read_text(), None

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (a run stops cleanly: checkpoint, summary, its Ray and Redis shut down),
        then SIGKILL to what is left of its process group."""
        if self.poll() is None:
            self.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # the group outlives its leader's exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=10)
        self._file.close()


# What an in-process Learner of an earlier test sets in this process (torch.distributed's
# rendezvous, gloo's interface) and DeepSpeed reads again later, so it stays: a process
# started here gets a shell's environment instead.
DISTRIBUTED_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
)  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment less DISTRIBUTED_ENV, with `extra` and Ray's auth off."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    return {**env, "RAY_AUTH_MODE": "disabled", **extra}


def staleflow(*args: str, cwd: Path, **kwargs) -> LoggedProcess:
    env = clean_env(PYTHONUNBUFFERED="1")
    log = Path(cwd) / f".staleflow-{time.monotonic_ns()}.log"
    return LoggedProcess(
        [sys.executable, "-m", "staleflow.cluster.cli", *args], log, cwd=cwd, env=env, **kwargs
    )


def stop_leftovers() -> None:
    """Stop every process started since the last call, and what is left of their groups."""
    while LoggedProcess.started:
        LoggedProcess.started.pop().stop()
