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
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import msgspec
import zmq

from vllm_omni.config.stage_config import PipelineConfig

logger = logging.getLogger(__name__)

_ATTEMPT_S = 10.0  # one registration attempt: the message waits in the socket while the head is down


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
        """Register with the head, retrying until `timeout_s`; raises RegistrationRefused or TimeoutError."""
        msg = encode(Register(stage_id, inbox, socket.gethostname(), os.getpid(), attach.fingerprint, attach.summary))
        deadline = time.monotonic() + timeout_s
        while True:
            # A fresh socket per attempt: a reply lost with an old one cannot register us twice later.
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(attach.master)
            sock.send(msg)
            wait_s = min(_ATTEMPT_S, max(0.0, deadline - time.monotonic()))
            if sock.poll(int(wait_s * 1000)):
                reply = FROM_MASTER.decode(sock.recv())
                if isinstance(reply, Accepted):
                    return cls(sock, reply, attach, stage_id)
                sock.close()
                reason = reply.reason if isinstance(reply, Refused) else f"unexpected {type(reply).__name__}"
                raise RegistrationRefused(f"the head at {attach.master} refused stage {stage_id}: {reason}")
            sock.close()
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
        last_answer = time.monotonic()
        ping = encode(Ping(self.accepted.session))
        while not self._stop.is_set() and self.lost is None:
            self._sock.send(ping)
            wait_until = time.monotonic() + interval
            while (left := wait_until - time.monotonic()) > 0 and not self._stop.is_set():
                if not self._sock.poll(int(left * 1000) + 1):
                    continue
                reply = FROM_MASTER.decode(self._sock.recv())
                if isinstance(reply, Pong):
                    last_answer = time.monotonic()
                    if not reply.known:
                        self.lost = "the head no longer knows this replica (it marked it down, or restarted)"
            silent = time.monotonic() - last_answer
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
