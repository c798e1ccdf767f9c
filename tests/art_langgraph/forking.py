"""A child forked while a thread of its parent holds one of the plugin's module locks (a fresh Python process).

In the child no thread would ever release a lock inherited held: the plugin's after-fork hook must renew it, or the
child hangs at its first use. The parent waits a bounded time and kills a hung child, so a hang fails the test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = """
import os, sys, threading, time, traceback
{imports}
held = threading.Event()
def holding():
    with {lock}:
        held.set()
        threading.Event().wait()
threading.Thread(target=holding, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    try:
{child}
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)
deadline = time.monotonic() + 20
while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
    time.sleep(0.05)
if not done[0]:
    os.kill(pid, 9)
assert done[0], "the child hung"
assert os.waitstatus_to_exitcode(done[1]) == 0, "the child failed"
"""


def run_child_of_held_lock(imports: str, lock: str, child: str) -> subprocess.CompletedProcess[str]:
    """Run `child` (statements) in a process forked while a thread of its parent holds `lock` (an expression, after
    `imports`); the finished script, whose return code is 0 only when the child ran to its end."""
    script = _SCRIPT.format(imports=imports, lock=lock, child=textwrap.indent(textwrap.dedent(child), " " * 8))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
