"""One torch thread for the test process and every service process it starts: OMP_NUM_THREADS=1
unless the environment sets it, set here before anything imports torch, inherited by children.

The suite runs several torch processes side by side (this process's transformers references, one
or two executors), and torch's default of a thread per core made them spin against each other
and against any other run on the machine. On a 2-core machine with another engineer's tests
running, the fast subset took 149 s with two threads and 74 s with one, and 16 transformers
greedy references of 48 tokens 8.1 s and 1.2 s; idle, three slow tests took 58 s and 54 s.
Nothing tested depends on the thread count.

GRPC_ENABLE_FORK_SUPPORT=false too (set before anything imports grpc): with grpcio 1.80-1.84
(grpc/grpc issue 43055, open) a child that subprocess.Popen forks while this process holds gRPC
channels can abort in gRPC's post-fork poller thread ("epoll_wait error: Bad file descriptor",
SIGABRT) before it execs. CI saw it once (test_health_needs_no_prompt's client, status -6). The
tests fork only to exec; nothing in a child uses the parent's gRPC state.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
