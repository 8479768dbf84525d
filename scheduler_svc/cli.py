"""`pagedserve-client`: a command-line client of the public Generate API. One prompt, or (without
one, on a terminal or with --chat) a chat that keeps the conversation; answers stream to stdout.
Talks only over the wire: must not import the scheduler's or the executor's code."""
from __future__ import annotations

import argparse
import os
import queue
import re
import sys
import threading

import grpc

from protos import generate_pb2, generate_pb2_grpc

EXIT_OK, EXIT_RPC_ERROR, EXIT_USAGE, EXIT_ABORTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
ADDRESS_ENV = "PAGEDSERVE_CLIENT_ADDRESS"
DEFAULT_ADDRESS = "127.0.0.1:50051"
# vLLM's server (as OpenAI's chat API) generates up to the model's length when max_tokens is
# unset, and `vllm complete` inherits the completions API's 16: the one lets a small model that
# loops stream for minutes, the other cuts answers mid-sentence. 512 holds a few paragraphs.
DEFAULT_MAX_TOKENS = 512
# The health service names a pagedserve process registers: which of the two serves an address.
SCHEDULER_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generator"].full_name
EXECUTOR_SERVICE = "pagedserve.v1.Executor"  # the executor's protos are not the client's
_UINT32_LIMIT = 2**32


class UsageError(Exception):
    """A bad command line, reported as one line on stderr with exit status 2."""


class NotAScheduler(Exception):
    """The address answers gRPC but does not serve Generate; the message says what it is."""


class Stalled(Exception):
    """No message from the server within --timeout seconds."""


def parse_token_ids(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; anything but comma-separated uint32s is a UsageError."""
    ids = []
    for piece in text.split(","):
        piece = piece.strip()
        if not re.fullmatch(r"[0-9]+", piece) or int(piece) >= _UINT32_LIMIT:
            raise UsageError(f"--token-ids: expected comma-separated integers, got {piece!r}")
        ids.append(int(piece))
    return ids


def set_options(req: generate_pb2.GenerateRequest, a: argparse.Namespace) -> None:
    """Sampling and stopping from the flags; --max-tokens 0 leaves the proto field unset (the
    server then generates up to the model's max length)."""
    req.request_id = a.request_id or ""
    req.sampling.temperature = a.temperature
    if a.top_p is not None:
        req.sampling.top_p = a.top_p
    req.sampling.top_k = a.top_k
    req.sampling.min_p = a.min_p
    if a.seed is not None:
        req.sampling.seed = a.seed
    if a.max_tokens:
        req.stopping.max_tokens = a.max_tokens
    req.stopping.stop.extend(a.stop or [])
    req.stopping.ignore_eos = a.ignore_eos


def build_request(a: argparse.Namespace, prompt: str) -> generate_pb2.GenerateRequest:
    """The request of one prompt: token ids, plain text, or a user message after --system."""
    if a.token_ids:
        req = generate_pb2.GenerateRequest(token_ids={"ids": parse_token_ids(prompt)})
    elif a.raw:
        req = generate_pb2.GenerateRequest(text=prompt)
    else:
        return chat_request(a, [*system_messages(a), ("user", prompt)])
    set_options(req, a)
    return req


def chat_request(a: argparse.Namespace,
                 messages: list[tuple[str, str]]) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest()
    for role, content in messages:
        req.chat.messages.add(role=role, content=content)
    set_options(req, a)
    return req


def system_messages(a: argparse.Namespace) -> list[tuple[str, str]]:
    return [("system", a.system)] if a.system else []


def stream_answer(stub, req: generate_pb2.GenerateRequest, a: argparse.Namespace):
    """Streams one Generate call to stdout; returns (text, final message). Ctrl-C
    (KeyboardInterrupt) cancels the call, so the server frees its pages at once, and propagates."""
    call = stub.Generate(req)  # no deadline: a stream that keeps sending is never cut
    pieces, final = [], None
    try:
        for msg in _messages(call, a.timeout):
            pieces.append(msg.text)
            if msg.finished:
                final = msg
            ids = "".join(f"{t} " for t in msg.token_ids)
            sys.stdout.write(ids if a.show_ids and not msg.finished else msg.text)
            sys.stdout.flush()
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise NotAScheduler(what_serves(a.address)) from err
        raise
    except BaseException:  # Ctrl-C, a stall, a closed stdout: the server stops generating
        call.cancel()
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces), final


def _messages(call, timeout: float):
    """The call's messages as they come; raises Stalled when none comes within `timeout` seconds
    (0: wait forever). Read in a thread of its own, so that the wait has a timeout."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        try:
            for msg in call:
                inbox.put(msg)
            inbox.put(None)
        except grpc.RpcError as err:
            inbox.put(err)

    threading.Thread(target=pump, daemon=True, name="generate-stream").start()
    while True:
        try:
            item = inbox.get(timeout=timeout or None)
        except queue.Empty:
            raise Stalled(f"no answer from the server for {timeout:g}s (--timeout)") from None
        if item is None:
            return
        if isinstance(item, grpc.RpcError):
            raise item
        yield item


def what_serves(address: str) -> str:
    """Why `address` answered Generate with UNIMPLEMENTED: an executor, or not pagedserve."""
    try:
        executor = _health_status(address, EXECUTOR_SERVICE, 5.0) is not None
    except grpc.RpcError:  # no health service there: not pagedserve's
        executor = False
    if executor:
        return (f"{address} is a pagedserve executor, not the scheduler: prompts go to the "
                f"scheduler's public address ({DEFAULT_ADDRESS} unless it was changed)")
    return (f"{address} does not serve {SCHEDULER_SERVICE}/Generate (UNIMPLEMENTED): is it the "
            "scheduler's public address?")


def finish_code(final: generate_pb2.GenerateResponse | None, max_tokens: int = 0) -> int:
    """Prints the summary line of a finished answer to stderr; its exit status (ABORTED: 3)."""
    if final is None:
        print("error: the stream ended without a final message", file=sys.stderr)
        return EXIT_RPC_ERROR
    reason = generate_pb2.FinishReason.Name(final.finish_reason)
    print(f"[{reason}, {final.prompt_tokens} prompt + {final.completion_tokens} completion tokens]",
          file=sys.stderr)
    if final.finish_reason == generate_pb2.FINISH_REASON_LENGTH and max_tokens:
        print(f"(stopped at --max-tokens {max_tokens}: give more, or 0 for up to the model's "
              "length)", file=sys.stderr)
    if final.finish_reason == generate_pb2.FINISH_REASON_ABORTED:
        print("error: the server aborted the request (cancelled or shutting down)", file=sys.stderr)
        return EXIT_ABORTED
    return EXIT_OK


# What grpc says of a peer that answers the HTTP/2 preface in HTTP/1 (the OpenAI API's port, or
# any web server).
_HTTP1_PEER = ("http1.x server", "Failed parsing HTTP/2")


def print_rpc_error(err: grpc.RpcError) -> None:
    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
    if err.code() == grpc.StatusCode.UNAVAILABLE and any(
            sign in (err.details() or "") for sign in _HTTP1_PEER):
        print("(that address speaks HTTP/1, not gRPC: is it the OpenAI API's HTTP port? "
              f"pagedserve-client talks to the scheduler's gRPC address, {DEFAULT_ADDRESS} "
              "unless it was changed)", file=sys.stderr)


def answer_or_report(stub, req, a: argparse.Namespace) -> tuple | None:
    """stream_answer's (text, final), or None once it has printed why the call failed (an RPC
    error or a stalled stream)."""
    try:
        return stream_answer(stub, req, a)
    except grpc.RpcError as err:
        print_rpc_error(err)
    except Stalled as err:
        print(f"error: {err}", file=sys.stderr)
    return None


def run_once(stub, a: argparse.Namespace, prompt: str) -> int:
    answer = answer_or_report(stub, build_request(a, prompt), a)
    if answer is None:
        return EXIT_RPC_ERROR
    _, final = answer
    return finish_code(final, _length_cap(a, final))


def read_user_line() -> str | None:
    """The next user line; None on EOF or /exit. Prompts only on a terminal."""
    try:
        line = input("> " if sys.stdin.isatty() else "")
    except EOFError:
        return None
    return None if line.strip() == "/exit" else line


def chat_turn(stub, a: argparse.Namespace, history: list, line: str) -> list:
    """One user turn; the history with the turn and its answer, or unchanged if the answer was
    cancelled (Ctrl-C), aborted or failed."""
    turn = [*history, ("user", line)]
    try:
        answer = answer_or_report(stub, chat_request(a, turn), a)
    except KeyboardInterrupt:
        print("\n[answer cancelled]", file=sys.stderr)
        return history
    if answer is None:
        return history
    text, final = answer
    done = finish_code(final, _length_cap(a, final)) == EXIT_OK
    return [*turn, ("assistant", text)] if done else history


def _length_cap(a: argparse.Namespace, final) -> int:
    """--max-tokens, when it is what ended the answer (0 otherwise)."""
    if final is None or not a.max_tokens or final.completion_tokens < a.max_tokens:
        return 0
    return a.max_tokens


def chat(stub, a: argparse.Namespace) -> int:
    """The interactive chat: /reset clears the history, /exit or EOF quits."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())

        print("chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    history = system_messages(a)
    while (line := read_user_line()) is not None:
        if line.strip() == "/reset":
            history = system_messages(a)
            print("[conversation cleared]", file=sys.stderr)
        elif line.strip():
            history = chat_turn(stub, a, history, line)
    return EXIT_OK


def resolve_prompt(a: argparse.Namespace) -> str | None:
    """The one-shot prompt (argument, else piped stdin), or None for the interactive chat."""
    if a.chat or (a.prompt is None and sys.stdin.isatty()):
        if a.prompt is not None:
            raise UsageError("--chat takes no prompt argument; type the messages instead")
        if a.raw or a.token_ids:
            raise UsageError("the chat sends chat messages; --raw and --token-ids need a prompt")
        return None
    prompt = a.prompt if a.prompt is not None else sys.stdin.read().rstrip("\n")
    if not prompt:
        raise UsageError("no prompt: give one, pipe one on stdin, or use --chat")
    if a.token_ids:
        parse_token_ids(prompt)
    return prompt


def check_health(address: str, timeout: float, role: str | None) -> int:
    """Prints what serves `address` (a scheduler or an executor) and its health; exit 0 when it
    is SERVING and, with `role`, is that role."""
    found = {}
    for name, service in (("scheduler", SCHEDULER_SERVICE), ("executor", EXECUTOR_SERVICE)):
        try:
            found[name] = _health_status(address, service, timeout)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return EXIT_RPC_ERROR
        if found[name] is not None:
            break
    name, status = next(((n, s) for n, s in found.items() if s is not None), (None, None))
    if name is None:
        print(f"{address}: neither a pagedserve scheduler nor an executor (its health service "
              f"knows neither {SCHEDULER_SERVICE} nor {EXECUTOR_SERVICE})", file=sys.stderr)
        return EXIT_RPC_ERROR
    if role is not None and name != role:
        print(f"{address}: a pagedserve {name}, not the {role} ({status})", file=sys.stderr)
        return EXIT_RPC_ERROR
    print(f"{address}: {status}" + ("" if name == "scheduler" else
                                    " (a pagedserve executor, not the scheduler)"))
    return EXIT_OK if status == "SERVING" else EXIT_RPC_ERROR


def _health_status(address: str, service: str, timeout: float) -> str | None:
    """`service`'s health status name at `address`; None if its health service does not know
    it. Raises the RpcError of any other failure."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _int_in(text: str, low: int, limit: int, what: str) -> int:
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()) or not low <= int(text) < limit:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    return int(text)


def _max_tokens(text: str) -> int:
    return _int_in(text, 0, _UINT32_LIMIT, "non-negative")


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    return _int_in(text, 0, 2**64, "non-negative")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default: off for switches, none where unset."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not action.option_strings or action.dest in ("help", "address") or not action.help:
            return action.help  # the address says its default itself (its variable may set it)
        shown = ("off" if action.default is False else "none" if action.default is None
                 else "%(default)s")
        return f"{action.help} (default: {shown})"


def build_parser(default_address: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve-client", formatter_class=_HelpFormatter,
        description="Streams an answer from pagedserve's Generate API: to one prompt, or (with no "
                    "prompt on a terminal, or with --chat) in a chat that keeps the conversation.")
    p.add_argument("prompt", nargs="?", help="the prompt: a user chat message unless --raw or "
                   "--token-ids; read from stdin when not given and stdin is not a terminal")
    p.add_argument("--chat", action="store_true", help="interactive chat, even when stdin is not "
                   "a terminal (one message a line; /reset clears the history, /exit or EOF quits)")
    p.add_argument("--address", default=default_address,
                   help=f"the scheduler's public address (default: {DEFAULT_ADDRESS}; "
                        f"environment: {ADDRESS_ENV})")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as plain text, no chat template")
    p.add_argument("--token-ids", action="store_true",
                   help="the prompt is comma-separated token ids")
    p.add_argument("--system", default=None, help="a system message to put first")
    p.add_argument("--max-tokens", type=_max_tokens, default=DEFAULT_MAX_TOKENS,
                   help="new tokens at most; 0: up to the model's max length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0: off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="minimum probability relative to the top token")
    p.add_argument("--seed", type=_non_negative_int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--show-ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--request-id", default=None, help="an id for the server's logs")
    p.add_argument("--timeout", type=_timeout, default=300.0,
                   help="seconds to wait for the first token, then for each next one, before "
                        "giving up (a stream that keeps sending is never cut); 0: forever")
    p.add_argument("--health", action="store_true",
                   help="only check health: print whether the address is a pagedserve scheduler "
                        "or executor and its grpc.health.v1 status (exit 0 when SERVING)")
    p.add_argument("--service", choices=["scheduler", "executor"], default=None,
                   help="with --health: exit 1 unless the address is this service")
    return p


def run(argv: list[str] | None) -> int:
    a = build_parser(os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)).parse_args(argv)
    if a.service and not a.health:
        print("pagedserve-client: --service goes with --health", file=sys.stderr)
        return EXIT_USAGE
    if a.health:
        return check_health(a.address, min(a.timeout or 5.0, 5.0), a.service)
    try:
        prompt = resolve_prompt(a)
    except UsageError as err:
        print(f"pagedserve-client: {err}", file=sys.stderr)
        return EXIT_USAGE
    with grpc.insecure_channel(a.address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        try:
            return chat(stub, a) if prompt is None else run_once(stub, a, prompt)
        except NotAScheduler as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_RPC_ERROR


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 finished, 1 RPC error, 2 usage, 3 aborted by the server, 130 Ctrl-C."""
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("\npagedserve-client: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout closed early (`| head`): stop quietly, and keep Python's exit flush from failing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_RPC_ERROR


if __name__ == "__main__":
    sys.exit(main())
