"""What guards the stage transport's sockets: CurveZMQ on TCP links, size caps, and a count of
everything dropped.

- `secure_server` / `secure_client` put a socket under the cluster's CurveZMQ keys
  (cluster_secret.py); `ZapGuard` is the ZAP handler of one zmq context, which lets a client in
  only with the cluster's client key.
- `cap_size` sets ZMQ_MAXMSGSIZE: ZMQ drops the connection of a peer that announces a larger
  frame before it allocates it; the readers check what they decode too (transport.py).
- `DropCounter` counts what was dropped, by socket, stage and reason, and logs it at most once
  per `LOG_EVERY_S` for each of them (a flood must not flood the log). The head's /metrics
  exports the counts as `vllm_omni:transport_dropped_total`.
- `ConnectionWatch` reads a server socket's monitor events: handshakes that failed (a wrong or
  missing secret) and connections that closed before any handshake (not ZMQ at all).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from vllm_omni.engine.cluster_secret import CurveKeys

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
# The caps' defaults (their flags: --omni-max-message-bytes, --omni-max-replicas-per-stage,
# --omni-registration-rate). The largest message (header, frames and shared memory segments
# together) of a stage link: thinker hidden states of a 32k-token prompt in bfloat16 are ~0.5 GiB.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_MAX_REPLICAS_PER_STAGE = 16
DEFAULT_REGISTRATION_RATE = 10.0  # per second, and as many at once
# A CURVE handshake takes a few milliseconds; a peer that connects and says nothing is cut off
# after this, instead of ZMQ's 30 s, so idle connections cannot pile up file descriptors.
HANDSHAKE_IVL_MS = 5000


# --------------------------------------------------------------------------- counting drops


@dataclass(frozen=True, order=True)
class DropKey:
    socket: str  # registration, outputs, inbox
    stage: str  # the stage id ("" for the registration socket)
    reason: str  # undecodable, oversized, foreign_shm, handshake_failed, not_zmtp, rate_limited, ...


class DropCounter:
    """Thread-safe counts of dropped frames, connections and registrations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[DropKey] = Counter()
        self._last_log: dict[DropKey, float] = {}
        self._unlogged: Counter[DropKey] = Counter()

    def drop(self, key: DropKey, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._counts[key] += 1
            if now - self._last_log.get(key, -LOG_EVERY_S) < LOG_EVERY_S:
                self._unlogged[key] += 1
                return
            self._last_log[key] = now
            also = self._unlogged.pop(key, 0)
        where = f"the {key.socket} socket" + (f" of stage {key.stage}" if key.stage else "")
        more = f" ({also} more like it since the last report)" if also else ""
        logger.warning("dropped on %s (%s): %s%s", where, key.reason, detail, more)

    def snapshot(self) -> dict[DropKey, int]:
        with self._lock:
            return dict(self._counts)


def merge_counts(*counts: dict[DropKey, int]) -> dict[DropKey, int]:
    total: Counter[DropKey] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


# --------------------------------------------------------------------------- socket setup


def cap_size(sock: zmq.Socket, max_bytes: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """A socket that binds: CURVE server with the cluster's server keys (None: loopback, plain)."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """A socket that connects: it proves the client key and expects the cluster's server key."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


class ZapGuard:
    """The ZAP handler of one zmq context: a CURVE client is let in only with the cluster's client
    key. Start it before any CURVE server socket of the context binds (without a handler ZMQ lets
    every client in), stop it before the context ends."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._client_public = keys.client_public
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("vllm_omni.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", self)

    def callback(self, domain: str, client_key: bytes) -> bool:  # zmq.auth's credentials provider
        return client_key == self._client_public

    def stop(self) -> None:
        self._auth.stop()


# --------------------------------------------------------------------------- connection monitor

_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the peer's key was refused (not the cluster secret)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (another secret, or none)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
}
_WATCHED = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_MONITOR_STOPPED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class ConnectionWatch:
    """Counts the connections to a bound socket that failed or never began a handshake, from a
    thread of its own reading the socket's monitor. Ends when the socket closes."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, counter: DropCounter, socket_name: str,
                 stage: str) -> None:
        address = f"inproc://vomni-monitor-{uuid.uuid4().hex}"
        sock.monitor(address, _WATCHED)
        self._events = ctx.socket(zmq.PAIR)
        self._events.connect(address)
        self._counter = counter
        self._keys = {reason: DropKey(socket_name, stage, reason) for reason in ("handshake_failed", "not_zmtp")}
        self._thread = threading.Thread(target=self._run, name=f"{socket_name}{stage}-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # ZMQ reports the end of a handshake without the connection's descriptor: a connection
        # whose own accept-to-close saw no handshake outcome at all closed before one began.
        outcomes = 0
        accepted: dict[int, int] = {}  # descriptor -> outcomes seen when it was accepted
        try:
            while True:
                event = recv_monitor_message(self._events)
                kind = event["event"]
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    return
                if kind == zmq.EVENT_ACCEPTED:
                    accepted[event["value"]] = outcomes
                elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    outcomes += 1
                elif kind in _HANDSHAKE_FAILED:
                    outcomes += 1
                    self._counter.drop(self._keys["handshake_failed"], _HANDSHAKE_FAILED[kind])
                elif kind == zmq.EVENT_DISCONNECTED and accepted.pop(event["value"], None) == outcomes:
                    self._counter.drop(self._keys["not_zmtp"], "a connection closed before any ZMQ handshake")
        except zmq.ZMQError:
            return  # the context is ending
        finally:
            self._events.close(linger=0)
