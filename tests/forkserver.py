"""Fresh Python processes for the tests, cheaper: a fork server.

A test that needs a new process (a script run as ``python SCRIPT ARGS`` or ``python -c
CODE``, a resume in another process, a process that kills itself, the ranks of a
torch.distributed group) paid about 3.3 s of CPU per child to import torch and roundpipe.
Here one server process per pytest process (tests/conftest.py's session fixture
``forkserver``, started on first use, closed at the session's end; one per xdist worker)
imports torch, tabulate and roundpipe once, and forks one child per request.  Each child
is its own process with its own exit status (-SIGNAL when a signal ended it), its own
stdout and stderr (files, read back), cwd, environment and arguments, and runs the script
with ``runpy`` as ``__main__`` (or the code, with ``sys.path[0] = ''`` as ``-c`` has).  The
server does not wait for one child before forking the next: several children run at
once (two ranks talking over gloo), and each one's exit status is reported by its pid.

Why a child is as fresh as a new interpreter for what these tests check:

* Before forking, the server only imports torch, tabulate, roundpipe and the parts of
  torch a first trace imports (torch.export, Dynamo, AOTAutograd).  It starts no
  thread (checked), draws no torch random number (checked: the default generator is still
  at its initial seed's state) and initialises no CUDA (checked); nothing else runs.
* In the child, stdin is /dev/null and stdout/stderr are the request's files: none of the
  server's pipes stays open.  The torch CPU generator, ``random`` and numpy's global
  generator are re-seeded from the OS, as a new interpreter seeds them, so children do not
  share the server's draws.
* At the child's end, non-daemon threads are joined and atexit handlers run, as at a
  normal interpreter exit, then the child exits with the script's status (an uncaught
  exception prints its traceback and exits 1, ``SystemExit`` as Python reads it).

What a forked child cannot change: variables read when the interpreter or torch starts
(``PYTHON*``, ``OMP_*``, ``MKL_*``, ``KMP_*``, ``TORCH_*``, ``PYTORCH_*``); a request that
sets or removes one is refused (``ValueError``) rather than silently ignored.  The server
runs with the test process's environment plus this checkout on ``PYTHONPATH``.  Python's
string hash seed is the server's in every child (a new interpreter draws its own; no test
here depends on it).  Tests that check what a fresh interpreter imports or prints at its
top level (tests/test_backend.py, tests/test_cli.py, tests/test_messages_shapes.py,
transformers left alone by ``import roundpipe``) keep starting real interpreters.

Without ``os.fork`` (Windows, or where the tests ask for it) each request starts a new
interpreter with ``subprocess`` instead, behind the same interface.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240.0
# Read once when the interpreter or torch starts: a forked child cannot change them.
_FIXED_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_")


def _env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with this checkout's roundpipe first."""
    return {**environ, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, environ.get("PYTHONPATH")) if p)}


SERVER = r"""
import atexit, json, os, random, runpy, select, sys, threading, traceback, types
import torch, tabulate, roundpipe  # what every child imports, paid once
# and what a child's first trace imports lazily (~460 modules, ~0.8 s of CPU a child)
import torch.export, torch._dynamo, torch._functorch.aot_autograd, torch._dynamo.aot_compile

# Nothing but the imports ran: no thread, no random draw, no CUDA.
assert threading.active_count() == 1, threading.enumerate()
_g = torch.Generator()
_g.manual_seed(torch.initial_seed())
assert torch.equal(_g.get_state(), torch.get_rng_state()), "torch RNG drawn before fork"
assert not torch.cuda.is_initialized()
del _g


def _child(req):
    os.setpgid(0, 0)  # its own group: a timeout kills what it started too
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = out if req["err"] is None else os.open(
        req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {null, out, err}:
        os.close(fd)
    os.environ.update(req["env"])
    for key in req["unset"]:
        os.environ.pop(key, None)
    os.chdir(req["cwd"])
    torch.default_generator.seed()  # a new interpreter's seeds: from the OS
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    code = 1
    try:
        try:
            if req["script"] is None:
                sys.argv = ["-c"] + req["args"]
                sys.path[0] = ""
                sys.modules["__main__"] = main
                exec(compile(req["code"], "<string>", "exec"), main.__dict__)
            else:
                sys.argv = [req["script"]] + req["args"]
                sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
                runpy.run_path(req["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException as e:
            tb = e.__traceback__  # from the script's own frames, as python prints it
            while tb is not None and (tb.tb_frame.f_globals.get("_child") is _child
                                      or tb.tb_frame.f_code.co_filename == runpy.__file__):
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
        threading._shutdown()  # what interpreter exit does: join threads, then atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _say(msg):
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


buf = b""
live = set()
while True:
    if select.select([0], [], [], 0.05)[0]:
        data = os.read(0, 1 << 16)
        if not data:  # the tests closed the server: kill what a test left running
            for pid in live:
                try:
                    os.killpg(pid, 9)
                except OSError:
                    os.kill(pid, 9)
            for pid in live:
                os.waitpid(pid, 0)
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if "kill" in req:  # only a child not reaped yet: its pid is still its own
                if req["kill"] in live:
                    try:
                        os.killpg(req["kill"], 9)
                    except OSError:
                        os.kill(req["kill"], 9)
                continue
            pid = os.fork()
            if pid == 0:
                _child(req)
            try:
                os.setpgid(pid, pid)  # as the child does, so that no kill comes before it
            except OSError:
                pass  # the child did it first (or exited)
            live.add(pid)
            _say({"id": req["id"], "pid": pid})
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        live.discard(pid)
        _say({"pid": pid, "rc": os.waitstatus_to_exitcode(status)})
"""


class ChildTimeout(AssertionError):
    """A child ran past its timeout: it was killed (with what it started)."""


@dataclass(frozen=True)
class Result:
    """A finished child: exit status (-N for signal N), its stdout and stderr (stderr is
    "" where it was merged into stdout)."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class Child:
    """A started child; ``wait()`` returns its Result or raises ChildTimeout."""

    def __init__(self, server: "ForkServer", what: str, pid: int, out: str, err: str | None,
                 deadline: float, proc: subprocess.Popen | None = None) -> None:
        self.server, self.what, self.pid = server, what, pid
        self._out, self._err, self._deadline, self._proc = out, err, deadline, proc
        self._result: Result | None = None

    def _read(self, rc: int) -> Result:
        def text(path: str | None) -> str:
            if path is None:
                return ""
            with open(path, errors="replace") as f:
                return f.read()
        return Result(rc, text(self._out), text(self._err))

    def kill(self) -> None:
        """SIGKILL the child and whatever it started (its process group), if it is still
        running: the server (or Popen) knows whether it reaped it, after which its pid may
        be another process's."""
        if self._result is not None:
            return
        if self._proc is None:
            self.server._kill(self.pid)
        elif self._proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # start_new_session: its own group
            except (OSError, AttributeError):
                self._proc.kill()

    def wait(self) -> Result:
        if self._result is None:
            timed_out = False
            rc = self.server._wait(self, self._deadline)
            if rc is None:  # past the deadline
                timed_out = True
                self.kill()
                rc = self.server._wait(self, time.monotonic() + 60)
            self._result = self._read(-signal.SIGKILL if rc is None else rc)
            for path in (self._out, self._err):
                if path is not None:
                    os.remove(path)
            if timed_out:
                raise ChildTimeout(
                    f"{self.what} did not finish within its timeout (a hang?); killed. "
                    f"Its output:\n{self._result.output[-3000:]}")
        return self._result


class ForkServer:
    """Starts children forked from one server process (started on first use), or fresh
    interpreters where ``fork`` is missing or ``use_fork=False``."""

    def __init__(self, use_fork: bool | None = None) -> None:
        self.use_fork = hasattr(os, "fork") if use_fork is None else use_fork
        # The environment as the session started: a variable a test sets (monkeypatch)
        # before the server's first use must not reach every later child.
        self._environ = dict(os.environ)
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._started: dict[int, int] = {}  # request id -> pid
        self._rc: dict[int, int] = {}  # pid -> exit status
        self._next = 0
        self._dir = tempfile.mkdtemp(prefix="forkserver-")
        self.children = 0
        self._fresh: list[subprocess.Popen] = []  # without fork: killed at close if running

    # -- the server's side --------------------------------------------------------------
    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT,
                                          env=_env(self._environ), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE)
            self._buf = b""
        return self._proc

    def _pump(self, timeout: float) -> None:
        """Read what the server said within ``timeout`` seconds."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        if not select.select([fd], [], [], max(0.0, timeout))[0]:
            return
        data = os.read(fd, 1 << 16)
        if not data:
            self._proc = None
            raise RuntimeError(f"the fork server died (exit status {proc.wait()})")
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "rc" in msg:
                self._rc[msg["pid"]] = msg["rc"]
            else:
                self._started[msg["id"]] = msg["pid"]

    def _kill(self, pid: int) -> None:
        if self._proc is not None and pid not in self._rc:
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps({"kill": pid}) + "\n").encode())
            self._proc.stdin.flush()

    def _wait(self, child: Child, deadline: float) -> int | None:
        if child._proc is not None:
            try:
                return child._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
        while child.pid not in self._rc:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._pump(min(left, 1.0))
        return self._rc.pop(child.pid)

    # -- the tests' side ----------------------------------------------------------------
    def start(self, script: str | None = None, args: Sequence[str] = (), *,
              code: str | None = None, cwd: str | None = None,
              env: Mapping[str, str] | None = None, unset: Sequence[str] = (),
              timeout: float = TIMEOUT_S, merge_stderr: bool = False) -> Child:
        """Start ``python SCRIPT ARGS`` (or ``python -c CODE ARGS``) in ``cwd`` (default: the
        current directory) with ``env`` set and ``unset`` removed from the test process's
        environment; it is killed if it runs past ``timeout`` seconds."""
        if (script is None) == (code is None):
            raise ValueError("give a script or code, not both")
        env = dict(env or {})
        for key in list(env) + list(unset):
            if key.startswith(_FIXED_PREFIXES):
                raise ValueError(f"{key} is read when the interpreter or torch starts; a "
                                 "forked child cannot change it (set it for the server)")
        script = None if script is None else os.path.abspath(script)
        cwd = os.path.abspath(cwd or os.getcwd())
        self._next += 1
        out = os.path.join(self._dir, f"{self._next}.out")
        err = None if merge_stderr else os.path.join(self._dir, f"{self._next}.err")
        what = f"python {script or '-c ...'} {' '.join(args)}".rstrip()
        deadline = time.monotonic() + timeout
        self.children += 1
        if not self.use_fork:
            full = _env(self._environ)
            full.update(env)
            for key in unset:
                full.pop(key, None)
            with open(out, "w") as o, (open(err, "w") if err else o) as e:
                proc = subprocess.Popen(
                    [sys.executable] + (["-c", code] if script is None else [script])
                    + list(args), cwd=cwd, env=full, stdin=subprocess.DEVNULL,
                    stdout=o, stderr=e if err else subprocess.STDOUT,
                    start_new_session=hasattr(os, "setsid"))
            self._fresh.append(proc)
            return Child(self, what, proc.pid, out, err, deadline, proc)
        server = self._server()
        assert server.stdin is not None
        req = {"id": self._next, "script": script, "code": code, "args": list(args),
               "cwd": cwd, "env": env, "unset": list(unset), "out": out, "err": err}
        server.stdin.write((json.dumps(req) + "\n").encode())
        server.stdin.flush()
        start_by = time.monotonic() + 300  # the first request waits for the imports
        while self._next not in self._started:
            if time.monotonic() > start_by:
                raise RuntimeError("the fork server did not answer within 300 s")
            self._pump(1.0)
        return Child(self, what, self._started.pop(self._next), out, err, deadline)

    def run(self, script: str | None = None, args: Sequence[str] = (), **kwargs) -> Result:
        """``start(...)`` then ``wait()``."""
        return self.start(script, args, **kwargs).wait()

    def close(self) -> None:
        for fresh in self._fresh:
            if fresh.poll() is None:
                Child(self, "", fresh.pid, "", None, 0.0, fresh).kill()
                fresh.wait()
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()  # the server then kills any child a test left running
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)
