"""`pagedserve-client`: a command-line client of the public Generate API. One prompt, or (without
one, on a terminal or with --chat) a chat that keeps the conversation; answers stream to stdout.
Talks only over the wire: must not import the scheduler's or the executor's code."""
from __future__ import annotations

import argparse
import os
import re
import sys

import grpc

from protos import generate_pb2, generate_pb2_grpc

EXIT_OK, EXIT_RPC_ERROR, EXIT_USAGE, EXIT_ABORTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
ADDRESS_ENV = "PAGEDSERVE_CLIENT_ADDRESS"
_UINT32_LIMIT = 2**32


class UsageError(Exception):
    """A bad command line, reported as one line on stderr with exit status 2."""


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
    """Sampling and stopping from the flags; an unset --max-tokens leaves the proto field unset
    (the server then generates up to the model's max length)."""
    req.request_id = a.request_id or ""
    req.sampling.temperature = a.temperature
    if a.top_p is not None:
        req.sampling.top_p = a.top_p
    req.sampling.top_k = a.top_k
    req.sampling.min_p = a.min_p
    if a.seed is not None:
        req.sampling.seed = a.seed
    if a.max_tokens is not None:
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
    call = stub.Generate(req, timeout=a.timeout)
    pieces, final = [], None
    try:
        for msg in call:
            pieces.append(msg.text)
            if msg.finished:
                final = msg
            ids = "".join(f"{t} " for t in msg.token_ids)
            sys.stdout.write(ids if a.show_ids and not msg.finished else msg.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        call.cancel()
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces), final


def finish_code(final: generate_pb2.GenerateResponse | None) -> int:
    """Prints the summary line of a finished answer to stderr; its exit status (ABORTED: 3)."""
    if final is None:
        print("error: the stream ended without a final message", file=sys.stderr)
        return EXIT_RPC_ERROR
    reason = generate_pb2.FinishReason.Name(final.finish_reason)
    print(f"[{reason}, {final.prompt_tokens} prompt + {final.completion_tokens} completion tokens]",
          file=sys.stderr)
    if final.finish_reason == generate_pb2.FINISH_REASON_ABORTED:
        print("error: the server aborted the request (cancelled or shutting down)", file=sys.stderr)
        return EXIT_ABORTED
    return EXIT_OK


def print_rpc_error(err: grpc.RpcError) -> None:
    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)


def run_once(stub, a: argparse.Namespace, prompt: str) -> int:
    req = build_request(a, prompt)
    try:
        _, final = stream_answer(stub, req, a)
    except grpc.RpcError as err:
        print_rpc_error(err)
        return EXIT_RPC_ERROR
    return finish_code(final)


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
        text, final = stream_answer(stub, chat_request(a, turn), a)
    except KeyboardInterrupt:
        print("\n[answer cancelled]", file=sys.stderr)
        return history
    except grpc.RpcError as err:
        print_rpc_error(err)
        return history
    return [*turn, ("assistant", text)] if finish_code(final) == EXIT_OK else history


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


def check_health(address: str, timeout: float) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return EXIT_RPC_ERROR
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return EXIT_OK if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_RPC_ERROR


def _int_in(text: str, low: int, limit: int, what: str) -> int:
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()) or not low <= int(text) < limit:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    return _int_in(text, 1, _UINT32_LIMIT, "positive")


def _non_negative_int(text: str) -> int:
    return _int_in(text, 0, 2**64, "non-negative")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except the None and False of options that are off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


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
                   help=f"the scheduler's public address (environment: {ADDRESS_ENV})")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as plain text, no chat template")
    p.add_argument("--token-ids", action="store_true",
                   help="the prompt is comma-separated token ids")
    p.add_argument("--system", default=None, help="a system message to put first")
    p.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="new tokens at most (unset: up to the model's max length)")
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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--health", action="store_true",
                   help="only check the server's grpc.health.v1 status (exit 0 when SERVING)")
    return p


def run(argv: list[str] | None) -> int:
    a = build_parser(os.environ.get(ADDRESS_ENV, "127.0.0.1:50051")).parse_args(argv)
    if a.health:
        return check_health(a.address, min(a.timeout, 5.0))
    try:
        prompt = resolve_prompt(a)
    except UsageError as err:
        print(f"pagedserve-client: {err}", file=sys.stderr)
        return EXIT_USAGE
    with grpc.insecure_channel(a.address) as channel:
        stub = generate_pb2_grpc.GeneratorStub(channel)
        return chat(stub, a) if prompt is None else run_once(stub, a, prompt)


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
