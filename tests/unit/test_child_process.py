"""A child started through ``dies_with_parent`` gets SIGTERM when its parent is killed, and is an exec, not a fork."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from services.common.child_process import SETPRIV, dies_with_parent


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_child_goes_with_its_killed_parent(tmp_path):
    assert SETPRIV is not None, "setpriv (util-linux) is part of every supported machine"
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, time
        from services.common.child_process import dies_with_parent
        child = subprocess.Popen(dies_with_parent(["sleep", "60"]))
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)], cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the parent did not start its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        deadline = time.monotonic() + 10  # setpriv execs the command: the same pid becomes `sleep`
        while Path(f"/proc/{child}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "setpriv did not exec the command"
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def test_the_command_is_kept_whole():
    assert dies_with_parent(["etcd", "--name", "x"])[-3:] == ["etcd", "--name", "x"]
    assert Path(dies_with_parent(["x"])[0]).is_absolute()
