"""The hook a CLI agent runs before each of its tool calls: ask the job's gate service, answer in the CLI's
dialect. No proctor import and no pure-Python module at all (`python3 -I -S`): only the interpreter's C
modules (`sys`, `_socket`, `_signal`, `_json`), so it starts in the interpreter's own start-up time.

    hook_client.py SOCKET CLI EVENT < the CLI's hook JSON

Why only C modules: a CLI runs this as a fresh process for every tool call, and importing `json`, `socket`
and `signal` (which pull in `re`, `enum`, `selectors`, `collections`, `functools`) cost ~8 ms of each gated
call, more than the interpreter's start and the gate's decision together (issue 25, notes/hook25-readme.md).
The bytes sent and the answer read are the same as with those modules: the request is `json.dumps` of
{cli, event, payload} (ASCII-escaped strings, default separators), built with `_json`'s string encoder; the
answer is read by `_json`'s scanner, with `json.loads`'s rules (strict strings, nothing but whitespace after).

It is **fail-closed on proctor's side**: no answer within DEADLINE_S (below the CLI's own hook timeout), a
socket that is gone, an answer it cannot read — each is a deny with `[proctor GATE_UNAVAILABLE]`, in the form
the CLI blocks on (claude and gemini: exit 2 with the reason on stderr). Every CLI's hook layer fails open
on a crashed hook (research/gating.md), so this client must never crash into an allow: all of it is inside
one try, and a client stuck past its deadline anyway dies by SIGALRM. Dying (a signal, an interpreter that
cannot start) is outside any try: gemini and codex run the client under a shell wrapper that turns every
exit but 0 into exit 2; claude's `dontAsk` denies whatever its hook did not allow.
"""

import sys

DEADLINE_S = 20.0
MAX_INPUT = 4 * 1024 * 1024
WHITESPACE = " \t\n\r"  # what json.loads allows around a document


def deny(reason: str) -> int:
    sys.stderr.write(f"[proctor GATE_UNAVAILABLE] {reason}\n")
    return 2  # claude: "exit 2 blocks, stderr is the reason"; gemini: exit >= 2 denies with the text


class _Rules:
    """The decoding rules `json.loads` gives `_json.make_scanner` (JSONDecoder's defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        return float(name.replace("Infinity", "inf"))  # as json.loads: NaN, Infinity, -Infinity


def request(cli: str, event: str, payload: bytes) -> bytes:
    """`json.dumps({"cli": cli, "event": event, "payload": <payload as text>}) + "\\n"`, byte for byte."""
    import _json

    enc = _json.encode_basestring_ascii
    text = payload.decode("utf-8", "replace")
    return f'{{"cli": {enc(cli)}, "event": {enc(event)}, "payload": {enc(text)}}}\n'.encode("ascii")


def parse(data: bytes) -> object:
    """`json.loads(data.decode("utf-8"))`: a ValueError (or the scanner's StopIteration) when it is not one
    JSON document."""
    import _json

    text = data.decode("utf-8")
    start = len(text) - len(text.lstrip(WHITESPACE))
    value, end = _json.make_scanner(_Rules())(text, start)
    if text[end:].strip(WHITESPACE):
        raise ValueError("extra data after the gate's answer")
    return value


def ask(sock_path: str, cli: str, event: str, payload: bytes) -> int:
    import _socket

    data = request(cli, event, payload)
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.settimeout(DEADLINE_S)
        s.connect(sock_path)
        s.sendall(data)
        s.shutdown(_socket.SHUT_WR)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    finally:
        s.close()
    answer = parse(b"".join(chunks))
    if not isinstance(answer, dict):
        return deny("the gate's answer had no decision")
    out, err, code = answer["stdout"], answer.get("stderr", ""), answer["exit"]
    if not isinstance(out, str) or not isinstance(err, str) or not isinstance(code, int):
        return deny("the gate's answer had no decision")
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


def main(argv: list) -> int:
    try:  # the modules too are imported inside it: one missing is a deny, not a crash
        import _signal

        _signal.alarm(int(DEADLINE_S) + 5)  # default action: the process dies, never an exit 0
        if len(argv) != 4:
            return deny("usage: hook_client.py SOCKET CLI EVENT")
        payload = sys.stdin.buffer.read(MAX_INPUT + 1)
        if len(payload) > MAX_INPUT:
            return deny(f"the tool call is over {MAX_INPUT} bytes")
        return ask(argv[1], argv[2], argv[3], payload)
    except BaseException as exc:  # noqa: BLE001 - any failure is a deny, never an allow
        return deny(f"{type(exc).__name__}: {exc}"[:500])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
