"""What the WebUI checks before it serves, and the guard in front of every request.

Before binding: a port that is free and valid, and credentials whenever the page can be reached from
another machine (a non-loopback ``--host`` or ``--share``), unless ``--insecure`` says so explicitly.
Credentials come from ``--auth-file``, ``RLFACTORY_WEBUI_AUTH`` or ``--auth`` (the last shows in ``ps``).

In front of the app, one ASGI middleware (no imports: it only reads the ASGI scope):
- a request whose ``Origin`` is not the page's own (scheme-less ``host:port`` equal to the ``Host``
  header) is refused with 403, so another site open in the same browser can neither call the API nor
  post the login form (Gradio itself lets any origin through when it is not served on localhost);
- logins are throttled per client address: after ``FREE_FAILURES`` wrong passwords each further one
  locks that client out for a doubling time (``BASE_LOCK_S`` up to ``MAX_LOCK_S``), during which every
  login, the right password included, gets 429 with Retry-After. A success resets the count.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlfactory.errors import UserError

AUTH_ENV = "RLFACTORY_WEBUI_AUTH"
FREE_FAILURES = 3
BASE_LOCK_S = 2.0
MAX_LOCK_S = 300.0


# --------------------------------------------------------------------------- before serving
def parse_auth(text: str, source: str) -> tuple[str, str]:
    user, sep, password = text.strip().partition(":")
    if not sep or not user or not password:
        raise UserError(f"{source} must look like user:password")
    return user, password


def load_auth(auth: str | None, auth_file: str | None) -> tuple[str, str] | None:
    """Credentials from --auth-file, else --auth, else RLFACTORY_WEBUI_AUTH; None when none is set."""
    if auth and auth_file:
        raise UserError("give either --auth or --auth-file, not both")
    if auth_file:
        return parse_auth(_read_auth_file(Path(auth_file)), f"--auth-file '{auth_file}'")
    if auth:
        print(
            "warning: --auth user:password is visible to every user of this machine in the process list; "
            f"use --auth-file FILE or the {AUTH_ENV} environment variable instead",
            file=sys.stderr,
        )
        return parse_auth(auth, "--auth")
    text = os.environ.get(AUTH_ENV)
    return parse_auth(text, AUTH_ENV) if text else None


def _read_auth_file(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"--auth-file '{path}' cannot be read ({exc.__class__.__name__}); give a file holding user:password"
        ) from None
    if len(lines) != 1:
        raise UserError(f"--auth-file '{path}' must hold exactly one line user:password")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"warning: --auth-file '{path}' can be read by other users; run chmod 600 '{path}'", file=sys.stderr)
    return lines[0]


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` stands for is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_exposure(host: str, share: bool, credentials: Any, insecure: bool) -> None:
    """Refuse to serve to the network without credentials, unless --insecure (then say what is exposed)."""
    public = share or not is_loopback(host)
    if not public or credentials is not None:
        return
    where = "a public gradio.live link" if share else f"--host {host}"
    exposed = (
        "anyone who can reach it can read and write files in the workspace, start and stop training runs "
        "(which run reward and tool code named in their YAML) and load models"
    )
    if not insecure:
        raise UserError(
            f"{where} serves the WebUI to other machines, and {exposed}; set a password with "
            f"--auth-file FILE (one line user:password) or {AUTH_ENV}=user:password, serve on 127.0.0.1, "
            "or pass --insecure if that is really what you want"
        )
    print(f"warning: --insecure: serving on {where} without a password: {exposed}", file=sys.stderr)


def check_port(host: str, port: int) -> None:
    """A clear error for a port out of range or already in use (checked by binding it, then letting go)."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a valid port; give a number from 1 to 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"--host '{host}' is not an address of this machine ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(address)
        except PermissionError:
            raise UserError(f"--port {port}: not allowed to listen there (ports below 1024 need root)") from None
        except OSError as exc:
            raise UserError(
                f"--port {port} on {host} is not free ({exc.strerror}): another program (or WebUI) uses it; "
                "choose another with --port"
            ) from None


# --------------------------------------------------------------------------- while serving
class LoginThrottle:
    """Failed logins per client, with an exponential lock-out after the first few."""

    def __init__(self, free: int = FREE_FAILURES, base_s: float = BASE_LOCK_S, max_s: float = MAX_LOCK_S) -> None:
        self.free, self.base_s, self.max_s = free, base_s, max_s
        self._failures: dict[str, int] = {}
        self._locked_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def wait_s(self, client: str) -> float:
        """Seconds ``client`` must still wait before its next login attempt (0 when it may try)."""
        with self._lock:
            return max(0.0, self._locked_until.get(client, 0.0) - time.monotonic())

    def record(self, client: str, ok: bool) -> None:
        with self._lock:
            if ok:
                self._failures.pop(client, None)
                self._locked_until.pop(client, None)
                return
            failures = self._failures.get(client, 0) + 1
            self._failures[client] = failures
            if failures >= self.free:
                lock = min(self.base_s * 2 ** (failures - self.free), self.max_s)
                self._locked_until[client] = time.monotonic() + lock


def same_origin(origin: str, host: str) -> bool:
    """``Origin`` (scheme://host[:port]) names the server the request was sent to (``Host``)."""
    netloc = urlsplit(origin).netloc.lower()
    return bool(netloc) and netloc == host.lower()


class Guard:
    """ASGI middleware: same-origin requests only, throttled logins (see the module docstring)."""

    def __init__(self, app: Any, throttle: LoginThrottle | None = None) -> None:
        self.app = app
        self.throttle = throttle or LoginThrottle()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        origin = headers.get("origin")
        if origin is not None and not same_origin(origin, headers.get("host", "")):
            await _refuse(scope, send, 403, f"cross-origin request from {origin} refused")
            return
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/").endswith("/login"):
            await self._login(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _login(self, scope: dict, receive: Any, send: Any) -> None:
        client = (scope.get("client") or ("unknown",))[0]
        wait = self.throttle.wait_s(client)
        if wait > 0:
            seconds = math.ceil(wait)
            message = f"too many failed logins: try again in {seconds} s"
            await _refuse(scope, send, 429, message, [(b"retry-after", str(seconds).encode())])
            return
        status: dict[str, int] = {}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        self.throttle.record(client, ok=status.get("code") == 200)


async def _refuse(scope: dict, send: Any, code: int, text: str, extra: list | None = None) -> None:
    if scope["type"] == "websocket":  # closing before accepting answers the handshake with 403
        await send({"type": "websocket.close", "code": 1008})
        return
    body = (text + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": code, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
