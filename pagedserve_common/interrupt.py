"""Ctrl-C before a service serves: one line and exit status 130, at once, wherever loading is;
and how long a main thread may wait at a time where a signal handler must run."""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager

# The kernel hands a process's signal to any of its threads (a gRPC or a watcher thread); Python
# then only notes it, and runs the handler when the main thread next runs bytecode: a main thread
# blocked without a timeout (a queue's get, a condition's wait, waitpid) would never get there.
# Such waits wake this often.
SIGNAL_POLL_S = 0.5


@contextmanager
def interrupted_before_serving(prog: str):
    """Within: SIGINT writes one line and exits 130. Raising KeyboardInterrupt instead would land
    in an import or a library call that may wrap it (a class body's __set_name__ turns it into a
    RuntimeError) or swallow it; nothing serves yet, so there is nothing to drain. The service's
    own stop handler replaces this one once it serves; the previous handler is back after. A
    SIGINT the shell ignores (nohup, a background job) stays ignored."""
    previous = signal.getsignal(signal.SIGINT)
    ours = previous is signal.default_int_handler
    if ours:
        line = f"\n{prog}: interrupted (SIGINT) before serving; nothing was started\n".encode()

        def exit_130(signum, frame) -> None:
            os.write(2, line)  # not print: the main thread may be inside a write to stderr
            os._exit(130)
        signal.signal(signal.SIGINT, exit_130)
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)
