"""Whether the kernel lets one process read a sibling's memory here (`process_vm_readv`), as
the ranks of one host do to all-reduce directly; where it does not, they use the rings."""

from __future__ import annotations

import subprocess
import sys
import time

PROBE = """
import ctypes, sys
pid = int(sys.argv[1])
start = int(open(f"/proc/{pid}/maps").readline().split("-")[0], 16)
buf = ctypes.create_string_buffer(8)
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
n = libc.process_vm_readv(pid, ctypes.byref(Iov(ctypes.addressof(buf), 8)), 1,
                          ctypes.byref(Iov(start, 8)), 1, 0)
sys.exit(0 if n == 8 else 1)
"""


def sibling_reads_allowed() -> bool:
    """Whether one process may read a sibling's memory here (ptrace rules, seccomp), as the
    ranks of a job, children of one launcher, would."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        return (
            subprocess.run([sys.executable, "-c", PROBE, str(sleeper.pid)], timeout=30).returncode
            == 0
        )
    finally:
        sleeper.kill()
        sleeper.wait()
