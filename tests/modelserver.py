"""A scripted model API for the real agent CLIs: one tool call, then a final message; every request logged.

Speaks the three wire protocols the built-in adapters' CLIs use, all streaming (server-sent events):

- OpenAI Responses (`POST .../responses`, codex): a `function_call` (or `custom_tool_call`) output item;
- Anthropic Messages (`POST .../v1/messages`, claude): a `tool_use` content block;
- Gemini API (`POST .../models/M:streamGenerateContent`, gemini): a `functionCall` part; its non-streamed
  `generateContent` side calls (model routing, checks) get a plain JSON answer.

The script, per request, read from the conversation itself (so a CLI's side requests — a title, a routing
classifier — never advance it): the request carries our tool call's result -> the final message; it offers
tools -> the tool call that writes `WriteFile.name` in the agent's working directory with the CLI's own tool
(codex: `exec_command`, nested in the JavaScript of code mode's `exec` tool for 0.171's default model;
claude: `Write`; gemini: `run_shell_command`); otherwise -> a short plain answer.
`fail=401` (or any status) answers every model request with that status and the protocol's error body,
whose message carries `ERROR_MARK`.

HTTPS by default, with a throw-away CA (`ca_file`) made here: every CLI opens a CONNECT tunnel through
proctor's egress proxy. Point NODE_EXTRA_CA_CERTS (claude, gemini) or CODEX_CA_CERTIFICATE (codex) at
`ca_file`. `tls=False` is a local model server as most people run one (Ollama, vLLM, LM Studio): plain HTTP,
`url` http://, no CA, and its streamed answers sent with chunked transfer encoding, one server-sent event a
chunk, as those servers do (claude and codex send such requests to the proxy in absolute form).
Stdlib plus `cryptography` (a proctor dependency); usable outside pytest.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import re
import shlex
import ssl
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ERROR_MARK = "scripted-model-rejects-this-key"
FINAL_TEXT = "Done: the file is written."
SIDE_TEXT = "ok"


@dataclass(frozen=True)
class WriteFile:
    """What the scripted tool call does: write `content` to `name`, relative to the agent's cwd."""

    name: str = "hello.txt"
    content: str = "hello from the scripted model\n"

    def shell(self) -> str:
        return f"printf '%s' {shlex.quote(self.content)} > {shlex.quote(self.name)}"


@dataclass
class Logged:
    """One request as the server saw it, and what it answered (`reply`: tool_call | final | side | error |
    not_found)."""

    seq: int
    at: float
    method: str
    path: str
    protocol: str  # openai-responses | anthropic-messages | gemini | other
    headers: dict[str, str]
    body: Any
    reply: str = ""
    status: int = 200
    tool_result: str | None = None  # the tool's output the CLI sent back, when the request carries it
    tool_call: dict | None = None  # the call answered (reply tool_call): {"name", "input"}


def make_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 / localhost it signed: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proctor scripted-model test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(hours=1))
          .not_valid_after(now + _dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1)).not_valid_after(now + _dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def _sse(events: list[tuple[str | None, dict]]) -> bytes:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {json.dumps(data)}\n\n")
    return "".join(out).encode()


def _events(data: bytes) -> list[bytes]:
    """A server-sent-events body cut after each event's blank line: one chunk each."""
    parts = re.split(rb"(?<=\n\n)|(?<=\r\n\r\n)", data)
    return [p for p in parts if p]


def _text_of(value: Any) -> str:
    """Every string inside a JSON value, joined: where a tool's output hides in a CLI's request."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "\n".join(_text_of(v) for v in value.values())
    if isinstance(value, list):
        return "\n".join(_text_of(v) for v in value)
    return ""


_CWD_PATTERNS = (
    re.compile(r"Primary working directory: (\S+)"),
    re.compile(r"Working directory: (\S+)"),
    re.compile(r"<cwd>(\S+?)</cwd>"),
    re.compile(r"working (?:in|on) the directory:? `?(/\S+?)`?[\s.]"),
)


def _cwd(text: str) -> str | None:
    for pat in _CWD_PATTERNS:
        m = pat.search(text)
        if m:
            return m.group(1).rstrip(".`'\"")
    return None


def tool_results(body: dict, ids: Any) -> list[dict]:
    """The `tool_result` blocks of an Anthropic Messages request that answer one of our tool calls (`ids`)."""
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    return [b for m in messages if isinstance(m, dict) and m.get("role") == "user"
            and isinstance(m.get("content"), list)
            for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"
            and b.get("tool_use_id") in ids]


class ScriptedModel:
    """The server; a context manager. `url` is its https base (no path), `requests` the log (also written
    to `log_file` as JSON lines when given)."""

    def __init__(self, directory: Path, action: WriteFile = WriteFile(), *, fail: int | None = None,
                 final_text: str = FINAL_TEXT, log_file: Path | None = None, tls: bool = True) -> None:
        self.directory = directory
        self.action = action
        self.fail = fail
        self.final_text = final_text
        self.log_file = log_file
        self.requests: list[Logged] = []
        self.call_ids: set[str] = set()
        self._lock = threading.Lock()
        self.tls = tls
        self.ca_file: Path | None = None
        self._ctx: ssl.SSLContext | None = None
        if tls:
            self.ca_file, cert, key = make_tls(directory / "tls")
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            ctx.set_alpn_protocols(["http/1.1"])
            self._ctx = ctx
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                outer._handle(self)

            def do_GET(self) -> None:
                outer._handle(self)

            def do_HEAD(self) -> None:
                outer._handle(self)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False  # close() never joins a handler still reading an idle keep-alive socket

            def get_request(self):  # type: ignore[no-untyped-def]
                sock, addr = self.socket.accept()
                sock.settimeout(30)
                if outer._ctx is None:
                    return sock, addr
                return outer._ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.endpoint = f"127.0.0.1:{self.port}"  # an adapter `egress` entry
        self._thread = threading.Thread(target=self.server.serve_forever, name="scripted-model", daemon=True)

    def __enter__(self) -> ScriptedModel:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # shutdown() waits for serve_forever to notice, forever if it never ran (a test that failed between
        # building the model and `with model:`): that wait ended only at pytest-timeout's 300 s.
        if self._thread.is_alive():
            self.server.shutdown()
            self._thread.join(10)
        self.server.server_close()

    # --- reading the log ------------------------------------------------------------------------------

    def summary(self) -> list[str]:
        return [f"{r.method} {r.path} -> {r.status} {r.reply}" for r in self.requests]

    # --- one request ----------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = {"_unparsed": raw[:2000].decode("utf-8", "replace")}
        path = h.path
        protocol = ("openai-responses" if re.search(r"/responses(\?|$)", path) else
                    "anthropic-messages" if re.search(r"/v1/messages(\?|$)", path) else
                    "gemini" if re.search(r"/models/[^/:]+:(stream)?[gG]enerateContent", path) else "other")
        headers = {k.lower(): ("<redacted>" if k.lower() in ("authorization", "x-api-key", "x-goog-api-key")
                               else v) for k, v in h.headers.items()}
        with self._lock:
            entry = Logged(len(self.requests), time.time(), h.command, path, protocol, headers, body)
            self.requests.append(entry)
        if h.command != "POST" or protocol == "other":
            status, ctype, data = self._other(h.command, path, entry)
        elif self.fail:
            status, ctype, data = self._error(protocol, entry)
        else:
            handler = {"openai-responses": self._openai, "anthropic-messages": self._anthropic,
                       "gemini": self._gemini}[protocol]
            try:
                status, ctype, data = handler(body if isinstance(body, dict) else {}, path, entry)
            except Exception as exc:  # noqa: BLE001 - a script that cannot answer says why, in the log too
                entry.reply = f"server_error: {type(exc).__name__}: {exc}"
                status, ctype = 500, "application/json"
                data = json.dumps({"error": {"message": entry.reply}}).encode()
        entry.status = status
        if self.log_file is not None:
            with self._lock, self.log_file.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(asdict(entry)) + "\n")
        h.send_response(status)
        h.send_header("content-type", ctype)
        chunked = not self.tls and ctype == "text/event-stream"
        h.send_header(*(("transfer-encoding", "chunked") if chunked else ("content-length", str(len(data)))))
        if ctype == "text/event-stream":
            h.send_header("cache-control", "no-cache")
        h.end_headers()
        if h.command == "HEAD":
            return
        for part in _events(data) if chunked else [data]:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            h.wfile.flush()
        if chunked:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()

    def _new_call_id(self, prefix: str) -> str:
        cid = f"{prefix}{uuid.uuid4().hex[:20]}"
        with self._lock:
            self.call_ids.add(cid)
        return cid

    def _other(self, method: str, path: str, entry: Logged) -> tuple[int, str, bytes]:
        entry.reply = "not_found"
        return 404, "application/json", json.dumps({"error": {"message": f"no {method} {path} here"}}).encode()

    def _error(self, protocol: str, entry: Logged) -> tuple[int, str, bytes]:
        entry.reply = "error"
        status = self.fail or 500
        msg = f"{ERROR_MARK}: invalid API key"
        body = {"openai-responses": {"error": {"message": msg, "type": "invalid_request_error",
                                               "code": "invalid_api_key", "param": None}},
                "anthropic-messages": {"type": "error", "error": {"type": "authentication_error", "message": msg}},
                "gemini": {"error": {"code": status, "message": msg, "status": "UNAUTHENTICATED"}}}[protocol]
        return status, "application/json", json.dumps(body).encode()

    # --- OpenAI Responses (codex) ---------------------------------------------------------------------

    def _openai(self, body: dict, path: str, entry: Logged) -> tuple[int, str, bytes]:
        items = body.get("input") if isinstance(body.get("input"), list) else []
        results = [i for i in items if isinstance(i, dict)
                   and i.get("type") in ("function_call_output", "custom_tool_call_output")
                   and i.get("call_id") in self.call_ids]
        tools = {t.get("name"): t for t in body.get("tools") or [] if isinstance(t, dict)}
        # Code mode (0.171's default model): the tools come in an `additional_tools` input item, namespaced,
        # and the shell is a nested call made from the JavaScript of the custom tool `exec`.
        for i in items:
            if isinstance(i, dict) and i.get("type") == "additional_tools":
                for ns in i.get("tools") or []:
                    for t in (ns.get("tools") or [] if isinstance(ns, dict) else []):
                        if isinstance(t, dict):
                            tools.setdefault(t.get("name"), t)
        rid = f"resp_{uuid.uuid4().hex[:16]}"
        if results:
            entry.reply, entry.tool_result = "final", _text_of(results[-1].get("output"))
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:12]}", "role": "assistant",
                    "status": "completed", "content": [{"type": "output_text", "text": self.final_text,
                                                        "annotations": []}]}
        elif tools:
            entry.reply = "tool_call"
            item = self._codex_call(tools)
            entry.tool_call = {"name": item["name"], "input": item.get("input") or item.get("arguments")}
        else:
            entry.reply = "side"
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:12]}", "role": "assistant",
                    "status": "completed", "content": [{"type": "output_text", "text": SIDE_TEXT,
                                                        "annotations": []}]}
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
        base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": body.get("model", "m")}
        events: list[tuple[str | None, dict]] = [
            ("response.created", {"type": "response.created", "response": {**base, "status": "in_progress",
                                                                           "output": []}}),
            ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                            "item": item}),
        ]
        if item["type"] == "message":
            events.append(("response.output_text.delta", {"type": "response.output_text.delta",
                                                          "item_id": item["id"], "output_index": 0,
                                                          "content_index": 0,
                                                          "delta": item["content"][0]["text"]}))
        events += [
            ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
            ("response.completed", {"type": "response.completed",
                                    "response": {**base, "status": "completed", "output": [item], "usage": usage}}),
        ]
        return 200, "text/event-stream", _sse(events)

    def _codex_call(self, tools: dict[str, dict]) -> dict:
        cmd = self.action.shell()
        if "exec" in tools and tools["exec"].get("type") == "custom" and "exec_command" not in tools:
            js = f"const r = await tools.exec_command({json.dumps({'cmd': cmd})});\ntext(JSON.stringify(r));\n"
            return {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex[:12]}", "status": "completed",
                    "call_id": self._new_call_id("call_"), "name": "exec", "input": js}
        if "exec_command" in tools:
            name, args = "exec_command", {"cmd": cmd}
        elif "shell_command" in tools:
            name, args = "shell_command", {"command": cmd}
        elif "shell" in tools:
            name, args = "shell", {"command": ["bash", "-lc", cmd]}
        elif "apply_patch" in tools:
            lines = "".join(f"+{ln}\n" for ln in self.action.content.splitlines())
            patch = f"*** Begin Patch\n*** Add File: {self.action.name}\n{lines}*** End Patch\n"
            if tools["apply_patch"].get("type") == "custom":
                return {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex[:12]}", "status": "completed",
                        "call_id": self._new_call_id("call_"), "name": "apply_patch", "input": patch}
            name, args = "apply_patch", {"input": patch}
        else:
            raise ValueError(f"no shell or patch tool among {', '.join(sorted(map(str, tools)))}")
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:12]}", "status": "completed",
                "call_id": self._new_call_id("call_"), "name": name, "arguments": json.dumps(args)}

    # --- Anthropic Messages (claude) ------------------------------------------------------------------

    def _anthropic(self, body: dict, path: str, entry: Logged) -> tuple[int, str, bytes]:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        results = tool_results(body, self.call_ids)
        tools = {t.get("name"): t for t in body.get("tools") or [] if isinstance(t, dict)}
        model = body.get("model", "claude-scripted")
        mid = f"msg_{uuid.uuid4().hex[:20]}"
        if results:
            entry.reply, entry.tool_result = "final", _text_of(results[-1].get("content"))
            block: dict = {"type": "text", "text": self.final_text}
        elif "Write" in tools:
            entry.reply = "tool_call"
            cwd = _cwd(_text_of(body.get("system")) + "\n" + _text_of(messages)) or "."
            block = {"type": "tool_use", "id": self._new_call_id("toolu_"), "name": "Write",
                     "input": {"file_path": f"{cwd.rstrip('/')}/{self.action.name}", "content": self.action.content}}
            entry.tool_call = {"name": "Write", "input": block["input"]}
        elif "write" in tools:  # opencode's file tool: lowercase, the path as `filePath`
            entry.reply = "tool_call"
            cwd = _cwd(_text_of(body.get("system")) + "\n" + _text_of(messages)) or "."
            block = {"type": "tool_use", "id": self._new_call_id("toolu_"), "name": "write",
                     "input": {"filePath": f"{cwd.rstrip('/')}/{self.action.name}", "content": self.action.content}}
            entry.tool_call = {"name": "write", "input": block["input"]}
        else:
            entry.reply = "side"
            block = {"type": "text", "text": SIDE_TEXT}
        usage = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        start = {"type": "message_start", "message": {"id": mid, "type": "message", "role": "assistant",
                                                      "model": model, "content": [], "stop_reason": None,
                                                      "stop_sequence": None, "usage": usage}}
        if block["type"] == "text":
            opened = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
            stop = "end_turn"
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            stop = "tool_use"
        events: list[tuple[str | None, dict]] = [
            ("message_start", start),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": opened}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                               "usage": {"output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        return 200, "text/event-stream", _sse(events)

    # --- Gemini API (gemini) --------------------------------------------------------------------------

    def _gemini(self, body: dict, path: str, entry: Logged) -> tuple[int, str, bytes]:
        contents = body.get("contents") if isinstance(body.get("contents"), list) else []
        results = [p for c in contents if isinstance(c, dict) for p in c.get("parts") or []
                   if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict)
                   and p["functionResponse"].get("id", "") in self.call_ids | {""}
                   and p["functionResponse"].get("name") == "run_shell_command"]
        decls = {d.get("name") for t in body.get("tools") or [] if isinstance(t, dict)
                 for d in t.get("functionDeclarations") or [] if isinstance(d, dict)}
        streamed = ":streamGenerateContent" in path
        if not streamed:
            # A side call (model routing, a next-speaker or loop check): any well-formed JSON answer.
            entry.reply = "side"
            part: dict = {"text": json.dumps({"reasoning": "scripted", "model_choice": "flash",
                                              "complexity_reasoning": "scripted", "complexity_score": 1,
                                              "next_speaker": "user"})}
        elif results:
            entry.reply, entry.tool_result = "final", _text_of(results[-1]["functionResponse"].get("response"))
            part = {"text": self.final_text}
        elif "run_shell_command" in decls:
            entry.reply = "tool_call"
            part = {"functionCall": {"id": self._new_call_id("gem_"), "name": "run_shell_command",
                                     "args": {"command": self.action.shell(),
                                              "description": "write the file the task asks for"}}}
            entry.tool_call = {"name": "run_shell_command", "input": part["functionCall"]["args"]}
        else:
            entry.reply = "side"
            part = {"text": SIDE_TEXT}
        chunk = {"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}],
                 "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15},
                 "modelVersion": "gemini-scripted"}
        if not streamed:
            return 200, "application/json", json.dumps(chunk).encode()
        return 200, "text/event-stream", f"data: {json.dumps(chunk)}\r\n\r\n".encode()



# --- a script mode for an MCP host (claude with `--mcp-config`): two MCP tool calls, then an answer ------

@dataclass(frozen=True)
class McpCalls:
    """What the MCP script does: call `start` with `start_input`, then `wait` with the job id the first
    call's result names (`{"job": <jobId>, "wait_s": wait_s}`), then answer `final_text`."""

    start: str = "mcp__proctor__run_agent"
    start_input: dict | None = None
    wait: str = "mcp__proctor__job_result"
    wait_s: float = 60
    final_text: str = "The job finished."


_JOB_ID = re.compile(r'"jobId":\s*"([A-Za-z0-9._-]+)"')


def _anthropic_stream(block: dict, model: str) -> bytes:
    """One assistant message holding `block` (text or tool_use), as Messages server-sent events."""
    mid = f"msg_{uuid.uuid4().hex[:20]}"
    usage = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    if block["type"] == "text":
        opened, delta, stop = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}, "end_turn"
    else:
        opened = {**block, "input": {}}
        delta, stop = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}, "tool_use"
    return _sse([
        ("message_start", {"type": "message_start", "message": {"id": mid, "type": "message", "role": "assistant",
                                                                "model": model, "content": [], "stop_reason": None,
                                                                "stop_sequence": None, "usage": usage}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": opened}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ])


class McpScriptedModel(ScriptedModel):
    """The scripted model in MCP mode (Anthropic Messages only): the request offering `calls.start` gets that
    tool call; the one carrying its result gets the `calls.wait` call for the job id in it; the one carrying
    that result gets the final answer. `tool_result` of a logged request is the result it carried, whichever
    call it answers. Everything else (side requests, other protocols) is answered as ScriptedModel does."""

    def __init__(self, directory: Path, calls: McpCalls, **kw: Any) -> None:
        super().__init__(directory, final_text=calls.final_text, **kw)
        self.calls = calls
        self.answered: dict[str, str] = {}  # our tool_use id -> the tool it called

    def _mcp_call(self, name: str, tool_input: dict, entry: Logged) -> dict:
        cid = self._new_call_id("toolu_")
        with self._lock:
            self.answered[cid] = name
        entry.reply, entry.tool_call = "tool_call", {"name": name, "input": tool_input}
        return {"type": "tool_use", "id": cid, "name": name, "input": tool_input}

    def _anthropic(self, body: dict, path: str, entry: Logged) -> tuple[int, str, bytes]:
        results = tool_results(body, self.answered)
        tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
        model = body.get("model", "claude-scripted")
        last = results[-1] if results else None
        answers = self.answered.get(last.get("tool_use_id")) if last else None
        if last is not None:
            entry.tool_result = _text_of(last.get("content"))
        if answers == self.calls.wait:
            entry.reply = "final"
            block: dict = {"type": "text", "text": self.final_text}
        elif answers == self.calls.start:
            found = _JOB_ID.search(entry.tool_result or "")
            if found is None:
                entry.reply = "final"
                block = {"type": "text", "text": f"no job id in the {self.calls.start} result"}
            else:
                block = self._mcp_call(self.calls.wait, {"job": found.group(1), "wait_s": self.calls.wait_s},
                                       entry)
        elif self.calls.start in tools:
            block = self._mcp_call(self.calls.start, dict(self.calls.start_input or {}), entry)
        elif "ToolSearch" in tools and "ToolSearch" not in self.answered.values():
            # claude 2.1.332 defers MCP tools: the model loads them by name first, as a real model does.
            block = self._mcp_call("ToolSearch", {"query": f"select:{self.calls.start},{self.calls.wait}",
                                                  "max_results": 5}, entry)
        else:
            entry.reply = "side"
            block = {"type": "text", "text": SIDE_TEXT}
        return 200, "text/event-stream", _anthropic_stream(block, model)


# --- a script mode for claude's sub-agents: the main agent starts one, which makes the calls ----------------

SUB_MARK = "[scripted sub-agent]"


class SubagentScriptedModel(ScriptedModel):
    """Claude's sub-agents (Anthropic Messages only): the main conversation calls the sub-agent tool
    (`Agent`, or `Task` where that is its name; `Workflow` with a script of one agent() in WorkflowScripted)
    with a prompt carrying SUB_MARK; the sub-agent's own
    conversation (its first user message carries the mark) calls `Bash` with `bash_command`, then `Write`s
    the action's file, then answers; the main one, given the sub-agent's result, gives the final answer.
    `sub_calls`: the sub-agent's call ids and their tools, in order."""

    via = "Agent"  # or "Workflow": a workflow script whose one agent() is the sub-agent

    def __init__(self, directory: Path, action: WriteFile = WriteFile(), *, bash_command: str = "echo sub > bash.txt",
                 **kw: Any) -> None:
        super().__init__(directory, action, **kw)
        self.bash_command = bash_command
        self.sub_calls: dict[str, str] = {}  # the sub-agent's call ids -> tool, in order
        self.started: str | None = None

    def _block(self, name: str, tool_input: dict, entry: Logged, sub: bool) -> dict:
        cid = self._new_call_id("toolu_")
        if sub:
            self.sub_calls[cid] = name
        entry.reply, entry.tool_call = "tool_call", {"name": name, "input": tool_input}
        return {"type": "tool_use", "id": cid, "name": name, "input": tool_input}

    def _anthropic(self, body: dict, path: str, entry: Logged) -> tuple[int, str, bytes]:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
        first = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), {})
        results = tool_results(body, self.call_ids)
        if results:
            entry.tool_result = _text_of(results[-1].get("content"))
        model = body.get("model", "claude-scripted")
        if SUB_MARK in _text_of(first.get("content")):
            done = {self.sub_calls[r["tool_use_id"]] for r in results if r.get("tool_use_id") in self.sub_calls}
            cwd = _cwd(_text_of(body.get("system")) + "\n" + _text_of(messages)) or "."
            if "Bash" not in done and "Bash" in tools:
                block = self._block("Bash", {"command": self.bash_command, "description": "scripted"}, entry, True)
            elif "Write" not in done and "Write" in tools:
                block = self._block("Write", {"file_path": f"{cwd.rstrip('/')}/{self.action.name}",
                                              "content": self.action.content}, entry, True)
            else:
                entry.reply, block = "sub_final", {"type": "text", "text": "sub-agent done"}
        elif self.started is not None and any(r.get("tool_use_id") == self.started for r in results):
            entry.reply, block = "final", {"type": "text", "text": self.final_text}
        elif self.started is None and self.via == "Workflow" and "Workflow" in tools:
            script = ("export const meta = { name: 'scripted', description: 'write the file' }\n"
                      f"await agent({json.dumps(f'{SUB_MARK} Create {self.action.name}.')})\nreturn {{}}\n")
            block = self._block("Workflow", {"script": script}, entry, False)
            self.started = block["id"]
        elif self.started is None and self.via == "Agent" and tools & {"Agent", "Task"}:
            name = "Agent" if "Agent" in tools else "Task"
            block = self._block(name, {"description": "write the file", "subagent_type": "general-purpose",
                                       "prompt": f"{SUB_MARK} Create {self.action.name}."}, entry, False)
            self.started = block["id"]
        else:
            entry.reply, block = "side", {"type": "text", "text": SIDE_TEXT}
        return 200, "text/event-stream", _anthropic_stream(block, model)


class WorkflowScriptedModel(SubagentScriptedModel):
    via = "Workflow"
