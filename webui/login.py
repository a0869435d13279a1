"""The page's login: who may try a password and how often, and which routes answer before it.

Gradio checks the login on the routes that run events or serve files, but answers others without one (its
``/gradio_api/heartbeat/…`` stream, which an anonymous client can hold open, the streams' and the cancel and reset
routes, FastAPI's own ``/openapi.json`` …), and it asks the login function for a password without saying who asks.
:class:`LoginGate`, an ASGI middleware given to the app Gradio builds, fixes both: it refuses every request without
a valid login except the few the login form needs (:data:`PUBLIC_PATHS`), and it tells :class:`RateLimitedAuth`
the client's address, so five wrong passwords lock out that address only, not the owner (a share link would
otherwise let anyone lock the owner out, again and again). Gradio has no limit of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import sys
import time
from typing import Any, Dict, Iterator, Sequence

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

from webui.changes import logged_in

API_PREFIX = "/gradio_api"
# What the login form itself loads (seen in a browser before signing in), the login and logout, and the one call
# Gradio's launch makes to itself (startup-events, without a cookie).
PUBLIC_PATHS = frozenset({"/", "/login", "/login/", "/logout", "/logout/", "/theme.css", "/favicon.ico",
                          "/robots.txt", "/manifest.json", f"{API_PREFIX}/theme.css", f"{API_PREFIX}/startup-events"})
PUBLIC_PREFIXES = ("/static/", "/assets/", "/svelte/", "/pwa_icon")
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})

_CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("atelier_login_client", default="")


def current_client() -> str:
    """The address of the client whose request is being answered ("" outside a request)."""
    return _CLIENT.get()


@contextlib.contextmanager
def as_client(address: str) -> Iterator[None]:
    """Answer as ``address``: what :class:`LoginGate` does around every request (a test can do it too)."""
    token = _CLIENT.set(address)
    try:
        yield
    finally:
        _CLIENT.reset(token)


def client_address(scope: dict, share: bool = False) -> str:
    """The client's address: the connection's peer; with a share link, a request that comes through Gradio's share
    proxy (its tunnel client connects from this machine) carries the visitor's address as the last entry of
    ``X-Forwarded-For``, the one the proxy added (entries before it are whatever the visitor sent)."""
    peer = str((scope.get("client") or ("", 0))[0] or "")
    if not (share and peer in LOOPBACK):
        return peer
    forwarded = [value.decode("latin-1") for name, value in scope.get("headers") or [] if name == b"x-forwarded-for"]
    last = forwarded[-1].split(",")[-1].strip() if forwarded else ""
    return last or peer


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


class LoginGate:
    """ASGI middleware: with a login configured, a request without a valid session is refused (401; a websocket is
    closed) unless its route is one the login form needs; every request is answered knowing its client's address
    (:func:`current_client`). Give it to Gradio as ``app_kwargs={"middleware": [Middleware(LoginGate, ...)]}``:
    it is then part of the app from its first request."""

    def __init__(self, app: Any, share: bool = False, auth_message: str = ""):
        self.app, self.share, self.auth_message = app, share, auth_message

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        with as_client(client_address(scope, self.share)):
            server = scope.get("app")
            path, root = scope.get("path", "/"), scope.get("root_path", "")
            path = (path[len(root):] or "/") if root and path.startswith(root) else path
            if getattr(server, "auth", None) and not is_public(path) and not logged_in(server, HTTPConnection(scope)):
                await self.refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)

    async def refuse(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = {"detail": {"error": "Not authenticated", "auth_message": self.auth_message}}
        await JSONResponse(body, status_code=401)(scope, receive, send)


class RateLimitedAuth:
    """The login check: constant-time comparison of the given pairs, and two limits.

    - Per client address (:func:`current_client`): ``limit`` wrong passwords within ``window`` seconds refuse every
      login from that address, the right one too, for ``cooldown`` seconds. Other addresses (the owner) go on.
    - For everyone: once ``crowd`` or more addresses failed within ``window``, each login waits ``step`` seconds
      for every failing address beyond ``crowd - 1`` (at most ``max_delay``) before its password is looked at. This
      slows a guess spread over many addresses; it never refuses: the right password still gets in.

    Gradio calls :meth:`login` (a coroutine, so the wait does not hold up the server); calling the object checks
    without the wait."""

    def __init__(self, pairs: Sequence[tuple], limit: int = 5, window: float = 60.0, cooldown: float = 30.0,
                 crowd: int = 10, step: float = 0.5, max_delay: float = 8.0, clock: Any = None):
        self.pairs = [(str(u), str(p)) for u, p in pairs]
        self.limit, self.window, self.cooldown = limit, window, cooldown
        self.crowd, self.step, self.max_delay = crowd, step, max_delay
        self.clock = clock or time.monotonic
        self.failures: Dict[str, list] = {}       # address -> times of its wrong passwords within the window
        self.last_failure: Dict[str, float] = {}  # address -> its latest wrong password (the crowd's count)
        self.locked_until: Dict[str, float] = {}
        self.slowing = False

    def _forget(self, now: float) -> None:
        """Drop what the window no longer holds, so the tables stay as small as the last minute's traffic."""
        self.last_failure = {a: t for a, t in self.last_failure.items() if now - t < self.window}
        self.locked_until = {a: t for a, t in self.locked_until.items() if t > now}
        self.failures = {a: recent for a, recent in ((a, [t for t in ts if now - t < self.window])
                                                     for a, ts in self.failures.items()) if recent}

    def delay(self) -> float:
        """Seconds every login waits now (0 while fewer than ``crowd`` addresses failed within the window)."""
        now = self.clock()
        self._forget(now)
        over = len(self.last_failure) - self.crowd + 1
        wait = 0.0 if over <= 0 else min(self.max_delay, self.step * over)
        if bool(wait) != self.slowing:
            self.slowing = bool(wait)
            print(f"atelier: wrong logins from {len(self.last_failure)} addresses within {self.window:.0f} s: every "
                  "login now waits a little" if wait else "atelier: logins no longer wait", file=sys.stderr)
        return wait

    def __call__(self, username: str, password: str) -> bool:
        now = self.clock()
        self._forget(now)
        address = current_client()
        if now < self.locked_until.get(address, 0.0):
            return False
        ok = any(hmac.compare_digest(str(username).encode(), u.encode()) &
                 hmac.compare_digest(str(password).encode(), p.encode()) for u, p in self.pairs)
        if ok:
            return True
        times = self.failures.setdefault(address, [])
        times.append(now)
        self.last_failure[address] = now
        if len(times) >= self.limit:
            self.locked_until[address] = now + self.cooldown
            self.failures[address] = []
            print(f"atelier: {self.limit} wrong logins from {address or 'one address'} within {self.window:.0f} s: "
                  f"logins from there refused for {self.cooldown:.0f} s", file=sys.stderr)
        return False

    async def login(self, username: str, password: str) -> bool:
        """What Gradio calls: the crowd's wait, then the check."""
        wait = self.delay()
        if wait:
            await asyncio.sleep(wait)
        return self(username, password)


__all__ = ["LoginGate", "PUBLIC_PATHS", "RateLimitedAuth", "as_client", "client_address", "current_client",
           "is_public"]
