"""The hook a CLI agent runs before each of its tool calls: ask the job's gate service, answer in the CLI's
dialect. Standard library only and no proctor import, so it starts in milliseconds (`python3 -I -S`).

    hook_client.py SOCKET CLI EVENT < the CLI's hook JSON

It is **fail-closed on proctor's side**: no answer within DEADLINE_S (below the CLI's own hook timeout), a
socket that is gone, an answer it cannot read — each is a deny with `[proctor GATE_UNAVAILABLE]`, in the form
the CLI blocks on (claude and gemini: exit 2 with the reason on stderr). Every CLI's hook layer fails open
on a crashed hook (research/gating.md), so this client must never crash into an allow: all of it is inside
one try, and a client stuck past its deadline anyway dies by SIGALRM. Dying (a signal, an interpreter that
cannot start) is outside any try: gemini and codex run the client under a shell wrapper that turns every
exit but 0 into exit 2; claude's `dontAsk` denies whatever its hook did not allow.
"""

import json
import signal
import socket
import sys

DEADLINE_S = 20.0
MAX_INPUT = 4 * 1024 * 1024


def deny(reason: str) -> int:
    sys.stderr.write(f"[proctor GATE_UNAVAILABLE] {reason}\n")
    return 2  # claude: "exit 2 blocks, stderr is the reason"; gemini: exit >= 2 denies with the text


def ask(sock_path: str, cli: str, event: str, payload: bytes) -> int:
    request = json.dumps({"cli": cli, "event": event, "payload": payload.decode("utf-8", "replace")}) + "\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(DEADLINE_S)
        s.connect(sock_path)
        s.sendall(request.encode("utf-8"))
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    answer = json.loads(b"".join(chunks).decode("utf-8"))
    out, err, code = answer["stdout"], answer.get("stderr", ""), answer["exit"]
    if not isinstance(out, str) or not isinstance(code, int):
        return deny("the gate's answer had no decision")
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


def main(argv: list) -> int:
    try:
        signal.alarm(int(DEADLINE_S) + 5)  # default action: the process dies, never an exit 0
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
