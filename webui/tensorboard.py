"""TensorBoard inside the page's own address: ``<page>/tensorboard/``, behind the page's login.

Users of a share link, a cloud pod or Colab cannot reach another port of the training machine, so
TensorBoard is started on demand on a local port (``127.0.0.1`` only, ``--path_prefix /tensorboard``) and
the UI server forwards ``/tensorboard/…`` to it. The forwarding route asks for the same login as every
Gradio route (the session cookie Gradio sets at login), so it opens nothing the page does not.
"""

from __future__ import annotations

import atexit
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.routing import Route

from webui.changes import logged_in

PREFIX = "/tensorboard"
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
               "proxy-authenticate", "content-length", "content-encoding", "host"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoard:
    """One TensorBoard process for a workspace's runs, started when first asked for."""

    def __init__(self, logdir: Path, python: str = sys.executable):
        self.logdir = Path(logdir)
        self.python = python
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> str:
        """Start (once) and wait until it answers; "" when ready, else why not."""
        with self._lock:
            if not self.running():
                self.logdir.mkdir(parents=True, exist_ok=True)
                self.port = _free_port()
                cmd = [self.python, "-m", "tensorboard.main", "--logdir", str(self.logdir), "--host", "127.0.0.1",
                       "--port", str(self.port), "--path_prefix", PREFIX, "--reload_interval", "15"]
                try:
                    self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.PIPE)
                except OSError as exc:
                    return f"could not start TensorBoard: {exc}"
            end = time.time() + timeout
            while time.time() < end:
                if not self.running():
                    err = self.proc.stderr.read().decode(errors="replace").strip().splitlines() if self.proc else []
                    return f"TensorBoard exited: {err[-1] if err else 'no message'}"
                try:
                    if httpx.get(f"http://127.0.0.1:{self.port}{PREFIX}/", timeout=2).status_code < 500:
                        return ""
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            return f"TensorBoard did not answer within {timeout:.0f} s"

    def stop(self) -> None:
        if self.running():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def stop_with_this_process(board: TensorBoard) -> None:
    """Stop ``board`` when the UI process ends, however it is told to. Ctrl-C ends the serving loop and the caller's
    ``finally`` stops it, but SIGTERM (``kill``, systemd, a container's stop) and SIGHUP (a closed terminal) end a
    Python process at once by default, with no ``finally`` and no ``atexit``: TensorBoard was left running. Here
    they raise KeyboardInterrupt in the main thread instead, so the page shuts down as on Ctrl-C, and ``atexit``
    stops the board on any ordinary exit. Handlers another part of the program set are left alone."""
    atexit.register(board.stop)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread

    def interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, interrupt)


def mount(app: Any, board: TensorBoard) -> None:
    """Add ``/tensorboard/{path}`` to the served FastAPI app, first in line, behind the page's login."""

    async def forward(request: Request) -> Response:
        if not logged_in(app, request):  # the same check as Gradio's own routes (its login cookie)
            return Response("Not logged in: open the page and sign in first.", status_code=401)
        if not board.running() or board.port is None:
            return Response("TensorBoard is not running: press 'Open TensorBoard' on the Tools tab.", status_code=503)
        url = f"http://127.0.0.1:{board.port}{request.url.path[request.url.path.index(PREFIX):]}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != "cookie"}
        async with httpx.AsyncClient(timeout=60) as client:
            upstream = await client.request(request.method, url, params=request.query_params, headers=headers,
                                            content=await request.body())
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return Response(upstream.content, status_code=upstream.status_code, headers=out_headers)

    routes = [Route(PREFIX, forward, methods=["GET", "POST", "HEAD"]),
              Route(PREFIX + "/{path:path}", forward, methods=["GET", "POST", "HEAD"])]
    app.router.routes[0:0] = routes  # before Gradio's catch-all page route


__all__ = ["PREFIX", "TensorBoard", "mount", "stop_with_this_process"]
