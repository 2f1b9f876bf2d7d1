"""An ``lmsp`` command run in the test process: ``lmsp.cli.main``, the entry point of the console
script, with the ``LMSP_*`` environment, standard input and outputs the command would have had as a
process of its own, and its exit status. A command that only talks to the API or to Redis learns
nothing from a new interpreter, which costs a second or more of a loaded CPU; the service commands
(``api``, ``worker``, ``up``) and what a test must watch while it runs stay processes."""

import contextlib
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping

from lmsp import cli


@contextlib.contextmanager
def _lmsp_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with the ``LMSP_*`` variables of ``env`` instead of the test process's own."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("LMSP_")}
    for name in saved:
        del os.environ[name]
    os.environ.update({name: value for name, value in env.items() if name.startswith("LMSP_")})
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith("LMSP_")]:
            del os.environ[name]
        os.environ.update(saved)


def _exit_status(code: object, err: io.StringIO) -> int:
    """What the interpreter makes of ``SystemExit(code)``: a message is written out, status 1."""
    if code is None or isinstance(code, int):
        return code or 0
    err.write(f"{code}\n")
    return 1


def run_lmsp(*args: str, env: Mapping[str, str], stdin: str = "", timeout: float = 120) -> \
        "subprocess.CompletedProcess[str]":
    """``lmsp ARGS`` as ``subprocess.run(..., capture_output=True, text=True)`` would report it. It
    runs in a thread of its own: the operator commands run their own event loop (``asyncio.run``),
    which the test's running loop would refuse."""
    out, err = io.StringIO(), io.StringIO()
    status: list[int] = []
    failure: list[BaseException] = []

    def command() -> None:
        try:
            status.append(cli.main(list(args)))
        except SystemExit as exit_:
            status.append(_exit_status(exit_.code, err))
        except BaseException as exc:  # the test's thread raises it
            failure.append(exc)

    streams = (sys.stdin, sys.stdout, sys.stderr)
    with _lmsp_environment(env):
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), out, err
        try:
            # a daemon: a command that hangs fails its test (TimeoutExpired) without holding the run open
            thread = threading.Thread(target=command, name=f"lmsp {' '.join(args[:2])}", daemon=True)
            thread.start()
            thread.join(timeout)
        finally:
            sys.stdin, sys.stdout, sys.stderr = streams
    if thread.is_alive():
        raise subprocess.TimeoutExpired(["lmsp", *args], timeout, out.getvalue(), err.getvalue())
    if failure:
        raise failure[0]
    return subprocess.CompletedProcess(["lmsp", *args], status[0], out.getvalue(), err.getvalue())
