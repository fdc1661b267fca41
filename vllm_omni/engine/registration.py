"""The stage-based CLI's registration protocol: a headless stage replica joins the head over TCP.

    head (`serve MODEL --stage-id 0 -oma A -omp P`)      headless (`serve MODEL --headless --stage-id N -oma A -omp P`)
    ROUTER bound on tcp://A:P  <------------------------  DEALER: Register(stage, inbox, pid, host, fingerprint)
                               ------------------------>  Accepted(session, replica, out_port, heartbeats) | Refused
    PUSH -> the replica's inbox (tcp://R:port, R = --omni-replica-address or the probed route to A)
    PULL bound on tcp://A:out_port  <-----------------  the replica's outputs and heartbeats (data plane, as local)
                               <------------------------  Ping(session) every heartbeat interval
                               ------------------------>  Pong(known): known=False tells it the head dropped it
                               <------------------------  Leave(session, reason) when it stops

Each replica process registers itself (a headless command with `--omni-dp-size-local 2` makes
two), retrying until `--stage-init-timeout`, so the head and its stages start in any order. The
fingerprint covers what head and stage must agree on (the model's config and the stage graph),
not per-process tuning such as `--gpu-memory-utilization`. A replica exits when the head stops
answering its pings for the heartbeat timeout, or answers that it no longer knows it.

Every link is CurveZMQ with the cluster secret's keys (cluster_secret.py). A CURVE handshake that
fails is silent to the connecting side, so the replica watches its registration socket's
handshake events: a head that refuses its key (or has another secret, or none) makes it exit at
once, saying so, instead of retrying until its deadline. A refusal the head marks retryable
(`retry_after_s`: registrations come too fast, or the stage has its maximum of replicas) is
retried until the deadline; any other ends the replica.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_omni.config.stage_config import PipelineConfig
from vllm_omni.engine.cluster_secret import HOW_TO_SET, CurveKeys
from vllm_omni.engine.transport_guard import cap_size, secure_client

logger = logging.getLogger(__name__)

_ATTEMPT_S = 10.0  # one registration attempt: the message waits in the socket while the head is down
# Registration messages are a few hundred bytes; the sockets take no more than this (ZMQ_MAXMSGSIZE).
CONTROL_MAX_BYTES = 64 * 1024


class Register(msgspec.Struct, tag="register"):
    stage_id: int
    inbox: str  # tcp://host:port the replica's inbox is bound on
    host: str
    pid: int
    fingerprint: str
    summary: str  # the fingerprint's inputs in words, for a refusal message


class Accepted(msgspec.Struct, tag="accepted"):
    session: str
    replica: int
    out_port: int  # on the master's address: where outputs and heartbeats go
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class Refused(msgspec.Struct, tag="refused"):
    reason: str
    retry_after_s: float | None = None  # set: the head is busy or full now; try again after this long


class Ping(msgspec.Struct, tag="ping"):
    session: str


class Pong(msgspec.Struct, tag="pong"):
    known: bool


class Leave(msgspec.Struct, tag="leave"):
    session: str
    reason: str


ToMaster = Union[Register, Ping, Leave]
FromMaster = Union[Accepted, Refused, Pong]
TO_MASTER = msgspec.msgpack.Decoder(ToMaster)
FROM_MASTER = msgspec.msgpack.Decoder(FromMaster)
encode = msgspec.msgpack.encode


class RegistrationRefused(RuntimeError):
    """The head answered, and refused this replica."""


def tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def routable_address(master_host: str) -> str:
    """This host's address on the route to the master (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, 9))
            return probe.getsockname()[0]
    except OSError as e:
        raise OSError(f"no route to the master address {master_host!r} (--omni-master-address): {e}") from None


def bind_address(host: str) -> str:
    """An IP to bind on for a host name (zmq binds interfaces, not names)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise OSError(f"cannot listen on {host!r} (--omni-master-address): {e}") from None


# --------------------------------------------------------------------------- fingerprint


def pipeline_summary(pipeline: PipelineConfig, model: str) -> str:
    """What a head and its headless stages must agree on, in words: the checkpoint's config and
    the stage graph. Per-process settings (memory, batch sizes, replicas, devices) are left out."""
    stages = ", ".join(
        f"{s.stage_id}:{s.model_stage or '-'}/{s.worker_type.value}/{s.engine_args.model_arch or '-'}"
        f"<-{list(s.engine_input_source)}" + (f" model {_model_identity(s.engine_args.model)}"
                                               if s.engine_args.model else "")
        for s in pipeline.stages)
    return f"model {_model_identity(model)}; async_chunk={pipeline.async_chunk}; stages {stages}"


def pipeline_fingerprint(summary: str) -> str:
    return hashlib.sha256(summary.encode()).hexdigest()[:16]


def _model_identity(model: str) -> str:
    # The same checkpoint may sit at different paths on different hosts: compare its config.
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        canonical = json.dumps(json.loads(config.read_text()), sort_keys=True)
        return f"{Path(model).name} (config.json {hashlib.sha256(canonical.encode()).hexdigest()[:12]})"
    return model


# --------------------------------------------------------------------------- the replica's side


@dataclass(frozen=True)
class RemoteAttach:
    """How a headless replica finds its head; part of its (picklable) WorkerSpec."""

    master_host: str
    master_port: int
    fingerprint: str
    summary: str
    keys: CurveKeys | None = field(default=None, repr=False)  # the cluster secret's (None: loopback, plain)

    @property
    def master(self) -> str:
        return tcp(self.master_host, self.master_port)


class MasterLink:
    """A registered replica's line to the head: pings it from a thread of its own and notices
    when it is gone. Owns its socket once `start`ed; `close` says goodbye."""

    def __init__(self, sock: zmq.Socket, accepted: Accepted, attach: RemoteAttach, stage_id: int) -> None:
        self.accepted = accepted
        self.attach = attach
        self.stage_id = stage_id
        self.lost: str | None = None  # why the head is gone, once it is
        self._sock = sock
        self._stop = threading.Event()
        self._leave_reason = "stopped"
        self._thread = threading.Thread(target=self._run, name=f"stage{stage_id}-master-link", daemon=True)

    @property
    def out_addr(self) -> str:
        return tcp(self.attach.master_host, self.accepted.out_port)

    @classmethod
    def register(cls, ctx: zmq.Context, attach: RemoteAttach, stage_id: int, inbox: str,
                 timeout_s: float) -> MasterLink:
        """Register with the head, retrying until `timeout_s`; raises RegistrationRefused (refused, or
        the handshake failed: another secret) or TimeoutError (no head answered)."""
        msg = encode(Register(stage_id, inbox, socket.gethostname(), os.getpid(), attach.fingerprint, attach.summary))
        deadline = time.monotonic() + timeout_s
        refused: Refused | None = None
        while True:
            wait_s = min(_ATTEMPT_S, max(0.0, deadline - time.monotonic()))
            # A fresh socket per attempt: a reply lost with an old one cannot register us twice later.
            sock, reply = _attempt(ctx, attach, msg, wait_s)
            if isinstance(reply, Accepted):
                return cls(sock, reply, attach, stage_id)
            sock.close()
            if isinstance(reply, Refused) and (reply.retry_after_s is None or time.monotonic() >= deadline):
                raise RegistrationRefused(f"the head at {attach.master} refused stage {stage_id}: {reply.reason} "
                                          f"(this stage's pipeline: {attach.summary})")
            if isinstance(reply, Refused):
                if refused is None or refused.reason != reply.reason:
                    logger.warning("stage %d: the head at %s cannot take it yet (%s); trying again", stage_id,
                                   attach.master, reply.reason)
                refused = reply
                time.sleep(min(reply.retry_after_s or 0.0, max(0.0, deadline - time.monotonic())))
                continue
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no head answered at {attach.master} within stage_init_timeout={timeout_s}s "
                                   "(is `vllm-omni serve MODEL --stage-id 0 --omni-master-address ... "
                                   "--omni-master-port ...` running there?)")
            logger.info("stage %d: no head at %s yet; still trying", stage_id, attach.master)

    def start(self) -> None:
        self._thread.start()

    def close(self, reason: str) -> None:
        """Tell the head this replica is leaving (best effort) and stop pinging."""
        self._leave_reason = reason
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        else:
            self._send_leave()

    def _run(self) -> None:
        interval, timeout = self.accepted.heartbeat_interval_s, self.accepted.heartbeat_timeout_s
        # The head's silence is counted in pings it left unanswered, not in wall time: a replica
        # that was itself stopped (SIGSTOP) for a while must not take its own pause for the head's.
        unanswered = 0
        ping = encode(Ping(self.accepted.session))
        while not self._stop.is_set() and self.lost is None:
            self._sock.send(ping)
            unanswered += 1
            wait_until = time.monotonic() + interval
            while (left := wait_until - time.monotonic()) > 0 and not self._stop.is_set():
                if not self._sock.poll(int(left * 1000) + 1):
                    continue
                reply = _decode_reply(self._sock.recv())
                if isinstance(reply, Pong):
                    unanswered = 0
                    if not reply.known:
                        self.lost = "the head no longer knows this replica (it marked it down, or restarted)"
            silent = unanswered * interval
            if self.lost is None and silent >= timeout:
                self.lost = f"the head at {self.attach.master} did not answer for {silent:.1f}s"
        if self.lost is not None:
            logger.error("stage %d: %s; exiting", self.stage_id, self.lost)
        self._send_leave()

    def _send_leave(self) -> None:
        if self._sock.closed:
            return
        try:
            self._sock.send(encode(Leave(self.accepted.session, self._leave_reason)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.info("stage %d: could not tell the head it leaves: %s", self.stage_id, e)
        finally:
            self._sock.setsockopt(zmq.LINGER, 1000)  # a moment for the goodbye to go out
            self._sock.close()


# --------------------------------------------------------------------------- one registration attempt

_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _attempt(ctx: zmq.Context, attach: RemoteAttach, msg: bytes,
             wait_s: float) -> tuple[zmq.Socket, Accepted | Refused | None]:
    """Send one Register and wait up to `wait_s` for the answer (None: none came). Raises
    RegistrationRefused at the first failed handshake (the head's ZAP handler refused our key, or
    the CURVE handshake failed: another secret, or none). Waiting for ZMQ's own reconnect to fail
    a second time cost up to 10 s on a loaded machine and tells nothing more: a lost connection
    is not a failed handshake."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    cap_size(sock, CONTROL_MAX_BYTES)
    secure_client(sock, attach.keys)
    address = f"inproc://vomni-handshake-{uuid.uuid4().hex}"
    sock.monitor(address, _HANDSHAKE_EVENTS)
    events = ctx.socket(zmq.PAIR)
    events.connect(address)
    try:
        sock.connect(attach.master)
        sock.send(msg)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(events, zmq.POLLIN)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if sock in ready:
                reply = _decode_reply(sock.recv())
                if isinstance(reply, (Accepted, Refused)):
                    return sock, reply
            if events in ready:
                kind = recv_monitor_message(events)["event"]
                sock.close()
                raise RegistrationRefused(_handshake_refusal(attach, kind))
        return sock, None
    finally:
        if not sock.closed:
            sock.disable_monitor()
        events.close(linger=0)


def _handshake_refusal(attach: RemoteAttach, event: int) -> str:
    if attach.keys is None:
        return (f"the head at {attach.master} refused the connection: it requires a cluster secret and this "
                f"process has none; {HOW_TO_SET}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the head at {attach.master} refused this process's key: its cluster secret differs from the "
                f"head's; {HOW_TO_SET}")
    return (f"the encrypted handshake with the head at {attach.master} failed: the head has another cluster "
            f"secret, or none; {HOW_TO_SET}")


def _decode_reply(payload: bytes) -> Accepted | Refused | Pong | None:
    try:
        return FROM_MASTER.decode(payload)
    except msgspec.DecodeError as e:
        logger.warning("ignored a reply from the head that does not decode: %s", e)
        return None
