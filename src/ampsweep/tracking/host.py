"""MLflow in a process of its own: the recorder host of a tracked ``ampsweep train``.

Importing MLflow with its SQLite store costs 1.2-2.2 s of CPU, as much as a default run's
training, and a run's first record needs it. So a tracked run forks, before it imports torch,
a process that imports MLflow while the command imports torch and composes its config, on the
other core (``app.startup`` starts it; docs/benchmarks.md has what it saves). The command's
store clients (``store.client_for``) are then ``RemoteClient``s: each call goes over a socket
to the host, which makes it on an ``MlflowClient`` of its own and answers with the result as
plain values (``Record``: an MLflow entity's properties as attributes), or with the error
under its original class name and text (``store.fault`` reads only the text). What needs
MLflow's own classes (entities, the model's MLmodel, the system monitors) is done there too,
by the functions of ``tracking.mlflow_calls``, named in ``store.run_with``.

The host serves only the process that forked it, one call at a time, and ends when that
process closes its end of the socket: at its exit, or killed (the kernel closes it). It ignores
SIGINT and SIGTERM, which a terminal and SLURM send to the whole process group: the command
itself records its end through the host when it stops. A call that finds the host gone (killed
on its own, say) is made in the command's process instead, with MLflow imported there, as it
would have been without a host.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import importlib
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

HEADER = struct.Struct("!Q")  # each message: its length, then the pickled message
# The functions a host runs by name (besides its clients' methods): named, not imported, since
# importing them imports MLflow, which the command leaves to the host.
FUNCTIONS = "ampsweep.tracking.mlflow_calls"
ENV_PREFIX = "MLFLOW_"  # what the command sets of these (credentials...), the host sees too
EXIT_WAIT_S = 10.0  # how long a command's exit waits for its host to end


class Record(SimpleNamespace):
    """An MLflow entity sent back from the host: its public properties, as attributes."""


class Records(list):
    """A list sent back from the host; a page of search results keeps its ``token``."""

    token: str | None = None


class RemoteError(Exception):
    """An exception raised in the host, re-raised in the command under its class's name."""

    def __reduce__(self):
        return remote_error, (type(self).__name__, str(self))


_ERROR_TYPES: dict[str, type[RemoteError]] = {}


def remote_error(name: str, text: str) -> RemoteError:
    """``text`` as an exception of a class named ``name`` (``MlflowException``, ...)."""
    if name not in _ERROR_TYPES:
        _ERROR_TYPES[name] = type(name, (RemoteError,), {"__module__": __name__})
    return _ERROR_TYPES[name](text)


class HostGone(Exception):
    """The host no longer answers (it was killed, or a call to it was interrupted)."""


class Host:
    """The command's end of a running host: the socket, and the host's process id."""

    def __init__(self, pid: int, sock: socket.socket, make_client: Callable[[str], Any]):
        self.pid, self._sock, self.make_client = pid, sock, make_client
        self.owner = os.getpid()  # a process forked from the command (a data loader) has none
        self.gone = False
        self._lock = threading.Lock()  # one call at a time: the training thread, the metrics
        # writer, the system sampler and a background closer all record
        # A process forked from the command (a DataLoader's worker) closes its copy of the
        # socket: the host then sees the end of the command's as soon as the command ends.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        if os.getpid() != self.owner:
            self.gone = True
            with contextlib.suppress(OSError):
                self._sock.close()

    @classmethod
    def start(cls, preload: Iterable[str], make_client: Callable[[str], Any],
              warm: Iterable[str] = ()) -> Host:  # fmt: skip
        """Fork the host: it imports ``preload`` (MLflow, ``FUNCTIONS``) and opens the stores
        ``warm`` (a SQLite store's first call opens its engine and checks its schema: 0.04 s
        a command no longer waits for), then serves calls on clients made by
        ``make_client(uri)`` and on the functions of ``FUNCTIONS``."""
        ours, theirs = socket.socketpair()
        for stream in (sys.stdout, sys.stderr):  # no buffered output printed twice
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:  # the host
            ours.close()
            _serve(theirs, tuple(preload), make_client, tuple(warm))
        theirs.close()
        return cls(pid, ours, make_client)

    def client(self, uri: str) -> RemoteClient:
        return RemoteClient(self, uri)

    def call(self, uri: str, kind: str, name: str, args: tuple, kwargs: dict) -> Any:
        """Make one call in the host; its result, or its error raised here."""
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
        request = _pack((kind, uri, name, args, kwargs, os.getcwd(), env))  # may refuse args
        if self.gone:  # before the lock: a forked process may have inherited it held
            raise HostGone(f"the recorder process {self.pid} ended")
        with self._lock:
            if self.gone:
                raise HostGone(f"the recorder process {self.pid} ended")
            try:
                self._sock.sendall(request)
                reply = _receive(self._sock)
            except BaseException as err:
                # Interrupted half-way, the replies would no longer match the calls: no more.
                self.gone = True
                if isinstance(err, OSError | EOFError):
                    raise HostGone(f"the recorder process {self.pid} ended") from err
                raise
            if reply is None:
                self.gone = True
                raise HostGone(f"the recorder process {self.pid} ended")
        if reply[0] == "error":
            raise remote_error(reply[1], reply[2])
        return reply[1]

    def close(self) -> None:
        """Close the command's end; the host ends, and is waited for."""
        self.gone = True
        with contextlib.suppress(OSError):
            self._sock.close()
        deadline = time.monotonic() + EXIT_WAIT_S
        while True:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done or time.monotonic() > deadline:
                if not done:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                return
            time.sleep(0.005)


class RemoteClient:
    """An ``MlflowClient`` for ``uri`` whose calls are made in the host: the same methods,
    results as plain values. ``run_there(name, ...)`` runs ``FUNCTIONS.name(client, ...)``
    there. Once the host is gone, both are made here on a client of this process."""

    def __init__(self, host: Host, uri: str):
        self._host, self.tracking_uri = host, uri
        self._local = None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def method(*args, **kwargs):
            return self._call("method", name, args, kwargs)

        method.__name__ = name
        return method

    def run_there(self, name: str, *args, **kwargs) -> Any:
        return self._call("function", name, args, kwargs)

    def _call(self, kind: str, name: str, args: tuple, kwargs: dict) -> Any:
        if self._local is None:
            try:
                return self._host.call(self.tracking_uri, kind, name, args, kwargs)
            except HostGone:
                self._local = self._host.make_client(self.tracking_uri)
        return _run(self._local, kind, name, args, kwargs)


# ---------------------------------------------------------------- which host, if any

_SERVING: list[Host] = []  # the one host of this process: a process resource, like its stdout


def serve_this_process(host: Host) -> None:
    """From now on, this process's store clients are ``host``'s (``app.startup``)."""
    _SERVING[:] = [host]


def serving() -> Host | None:
    """This process's host, if it has one (never a host started by another process)."""
    host = _SERVING[0] if _SERVING else None
    return host if host is not None and host.owner == os.getpid() else None


def stop_serving() -> None:
    """End this process's host, if any (at the command's exit)."""
    host = serving()
    _SERVING.clear()
    if host is not None:
        host.close()


# ---------------------------------------------------------------- the host's side


def _serve(sock: socket.socket, preload: tuple[str, ...], make_client, warm: tuple[str, ...]):
    """The host's life: import, then answer calls until the command closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = 0
    try:
        gc.disable()  # as app.startup imports: no collections over a growing heap
        for name in preload:
            importlib.import_module(name)
        gc.freeze()
        gc.enable()
        clients: dict[str, Any] = {}
        for uri in warm:
            try:
                clients[uri] = make_client(uri)
                clients[uri].search_experiments(max_results=1)
            except Exception:  # the command's own first call says what is wrong
                clients.pop(uri, None)
        while (request := _receive(sock)) is not None:
            kind, uri, name, args, kwargs, cwd, env = request
            _adopt(cwd, env)
            try:
                if uri not in clients:
                    clients[uri] = make_client(uri)
                reply = _pack(("ok", plain(_run(clients[uri], kind, name, args, kwargs))))
            except Exception as err:
                reply = _pack(("error", type(err).__name__, str(err)))
            sock.sendall(reply)
    except (OSError, EOFError):
        pass  # the command is gone
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)  # never the command's exit handlers, nor its buffered output


def run_here(client, name: str, *args, **kwargs) -> Any:
    """``FUNCTIONS.<name>(client, ...)`` in this process (which then imports MLflow)."""
    return getattr(importlib.import_module(FUNCTIONS), name)(client, *args, **kwargs)


def _run(client, kind: str, name: str, args: tuple, kwargs: dict) -> Any:
    if kind == "method":
        return getattr(client, name)(*args, **kwargs)
    return run_here(client, name, *args, **kwargs)


def _adopt(cwd: str, env: dict[str, str]) -> None:
    """The command's folder and MLflow variables, as they are now: a relative path or a
    credential the command set means the same here."""
    if cwd != os.getcwd():
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX) and k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


_ATOMS = (type(None), bool, int, float, str, bytes)


def plain(value: Any) -> Any:
    """``value`` made of Python's own types, ``Record`` and ``Records``: what the command
    unpickles without importing MLflow. An entity's public properties become attributes."""
    if type(value) in _ATOMS:
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        out = Records(plain(v) for v in value)
        out.token = getattr(value, "token", None)
        return out
    if type(value).__module__.split(".")[0] == "numpy":
        return value
    for base in _ATOMS[1:]:  # e.g. a str subclass
        if isinstance(value, base):
            return base(value)
    cls = type(value)
    names = [n for n in dir(cls) if not n.startswith("_") and isinstance(getattr(cls, n), property)]
    if not names:
        raise TypeError(f"the recorder process cannot send a {cls.__name__} back")
    return Record(**{n: plain(getattr(value, n)) for n in names})


def _pack(message: Any) -> bytes:
    """``message`` as it goes over the socket: its length, then its pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _receive(sock: socket.socket) -> Any:
    """The next message; None when the other end has closed."""
    header = _exactly(sock, HEADER.size)
    if header is None:
        return None
    data = _exactly(sock, HEADER.unpack(header)[0])
    if data is None:
        raise EOFError("the other end closed mid-message")
    return pickle.loads(data)  # noqa: S301 - our own process's messages, over a socketpair


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
