"""tests/forkserver.py: a child gets the session's environment plus what its request sets,
never a variable a test set in its own process (monkeypatch) before the server's first
use, which would otherwise reach every later child of the session."""

from __future__ import annotations

from forkserver import ForkServer

PROBE = "import os; print(os.environ.get('FORKSERVER_PROBE'), os.environ.get('FORKSERVER_SET'))"


def test_a_variable_set_in_the_test_process_does_not_reach_children(forkserver, monkeypatch):
    monkeypatch.setenv("FORKSERVER_PROBE", "leaked")
    result = forkserver.run(code=PROBE, env={"FORKSERVER_SET": "asked"})
    assert result.returncode == 0, result.output
    assert result.stdout.split() == ["None", "asked"]


def test_without_fork_a_child_gets_the_environment_of_the_servers_start(monkeypatch):
    server = ForkServer(use_fork=False)
    try:
        monkeypatch.setenv("FORKSERVER_PROBE", "leaked")
        result = server.run(code=PROBE, env={"FORKSERVER_SET": "asked"})
        assert result.returncode == 0, result.output
        assert result.stdout.split() == ["None", "asked"]
    finally:
        server.close()
