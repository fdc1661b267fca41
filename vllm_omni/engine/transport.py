"""Message encoding and the ZMQ sockets between the orchestrator and stage workers.

A message is sent as one multipart ZMQ message: frame 0 is the msgpack header; each
tensor in the message becomes a msgpack extension that points either at a later frame
(sent with `copy=False`, so the tensor's memory goes to the socket without a copy) or,
at `shm_threshold_bytes` and above, at a `multiprocessing.shared_memory` segment that
the receiver copies out and unlinks. Tensors are sent as raw bytes plus the torch
dtype name, so dtypes numpy lacks (bfloat16) travel unchanged.

Topology, per stage: the orchestrator binds the PULL socket that receives from the
worker, and connects a PUSH socket to the PULL socket the worker binds. A connecting
PUSH queues messages from the start (zmq creates its pipe at connect), so a request
sent the moment a stage is ready can never meet a half-made connection; whether the
worker is alive is the heartbeat's and the process sentinel's business, not the socket's.

What a receiver trusts (DESIGN 7): nothing. A message larger than `max_message_bytes` (its
frames and segments together), one that does not decode, or one that names a shared memory
segment its sender was not given (`LinkGuard.accept_shm_prefix`: each replica's sender gets
a prefix of its own at launch; a TCP peer none, it sends everything inline) is dropped,
counted and logged; the reader goes on. TCP links run CurveZMQ with the cluster's keys
(transport_guard.py).
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from vllm_omni.engine.cluster_secret import CurveKeys
from vllm_omni.engine.messages import FromWorker, ToWorker
from vllm_omni.engine.transport_guard import (
    DEFAULT_MAX_MESSAGE_BYTES, ConnectionWatch, DropCounter, DropKey, cap_size, secure_client, secure_server,
)

logger = logging.getLogger(__name__)

DEFAULT_SHM_THRESHOLD_BYTES = 65536
# Peers on different hosts share no memory: with this threshold every tensor travels inline.
INLINE_ONLY = sys.maxsize
_TENSOR_EXT = 1
_MAX_DIMS = 16
_SHM_DIR = "/dev/shm"  # where POSIX shared memory segments are visible on Linux
_SHM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class DroppedMessage(ValueError):
    """A received message the reader drops: `reason` is its /metrics label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class LinkGuard:
    """What protects one side of a stage link, and what its receiving socket accepts."""

    accept_shm_prefix: str | None = None  # segments it opens: names with this prefix only (None: none)
    keys: CurveKeys | None = None  # CurveZMQ on its tcp sockets (None: plain, for ipc and loopback)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    counter: DropCounter = field(default_factory=DropCounter)
    stage: str = ""  # for the counts and logs

    def drop(self, socket_name: str, e: DroppedMessage) -> None:
        self.counter.drop(DropKey(socket_name, self.stage, e.reason), str(e))


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"message carries a tensor of unknown dtype {name!r}")
    return dtype


class MessageCodec:
    """Encodes/decodes one direction's messages. Not thread-safe: one per socket owner.

    `shm_prefix` names the segments this side creates; `guard.accept_shm_prefix` the ones it
    accepts (its peer's prefix); both sides hold messages to `guard.max_message_bytes`."""

    def __init__(self, decode_type: Any, shm_threshold_bytes: int, shm_prefix: str,
                 guard: LinkGuard | None = None) -> None:
        if shm_threshold_bytes < 0:
            raise ValueError(f"shm_threshold_bytes={shm_threshold_bytes} is invalid: must be >= 0")
        self.shm_threshold_bytes = shm_threshold_bytes
        self.shm_prefix = shm_prefix
        self.guard = guard if guard is not None else LinkGuard()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(decode_type, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._out_frames: list[Any] = []
        self._new_segments: list[str] = []  # shared memory made for the message being encoded
        self._out_bytes = 0
        self._in_frames: list[zmq.Frame] = []
        self._in_bytes = 0

    # --- encoding -------------------------------------------------------------
    def encode(self, msg: Any) -> list[Any]:
        """The message's frames; ValueError when it exceeds max_message_bytes (nothing is sent)."""
        self._out_frames = []
        self._new_segments = []
        self._out_bytes = 0
        try:
            header = self._encoder.encode(msg)
            self._check_size(len(header) + self._out_bytes)
            return [header, *self._out_frames]
        except BaseException:
            # A message that fails halfway must not leave the segments of its earlier tensors.
            for name in self._new_segments:
                _unlink_shm(name)
            raise
        finally:
            self._out_frames = []
            self._new_segments = []

    def _enc_hook(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"cannot send a {type(obj).__name__} between stages: use tensors or msgpack data")
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        shape = list(t.shape)
        # A uint8 view of the flat tensor is valid for every dtype (including bfloat16).
        raw = t.reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        self._out_bytes += nbytes
        self._check_size(self._out_bytes)  # before a tensor over the limit is copied anywhere
        if nbytes >= self.shm_threshold_bytes and nbytes > 0:
            ref = [str(t.dtype), shape, -1, self._to_shm(raw)]
        else:
            self._out_frames.append(raw.numpy())  # zero-copy buffer; zmq keeps it alive until sent
            ref = [str(t.dtype), shape, len(self._out_frames), ""]
        return msgspec.msgpack.Ext(_TENSOR_EXT, msgspec.msgpack.encode(ref))

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.guard.max_message_bytes:
            raise ValueError(f"a message of {nbytes} bytes or more exceeds the stage links' message size limit of "
                             f"{self.guard.max_message_bytes} bytes (--omni-max-message-bytes)")

    def _to_shm(self, raw: torch.Tensor) -> str:
        name = f"{self.shm_prefix}{uuid.uuid4().hex[:16]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=raw.numel())
        try:
            torch.frombuffer(shm.buf, dtype=torch.uint8).copy_(raw)
        finally:
            shm.close()
        # The receiver owns (and unlinks) the segment; our tracker must not unlink it at exit.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        self._new_segments.append(name)
        return name

    # --- decoding -------------------------------------------------------------
    def decode(self, frames: list[zmq.Frame]) -> Any:
        """The message, or DroppedMessage saying why it is dropped (the reader logs and goes on)."""
        size = sum(len(f.buffer) for f in frames)
        if size > self.guard.max_message_bytes:
            raise DroppedMessage("oversized", f"a message of {size} bytes ({len(frames)} frames) exceeds "
                                              f"--omni-max-message-bytes={self.guard.max_message_bytes}")
        self._in_frames = frames
        self._in_bytes = size
        try:
            return self._decoder.decode(frames[0].buffer)
        except DroppedMessage:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a peer sent: msgspec, torch and shape errors alike
            raise DroppedMessage("undecodable", f"a message that does not decode ({len(frames)} frames, "
                                                f"{size} bytes): {type(e).__name__}: {e}") from None
        finally:
            self._in_frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _TENSOR_EXT:
            raise ValueError(f"unknown msgpack extension type {code}")
        dtype_name, shape, frame_index, shm_name = msgspec.msgpack.decode(data)
        dtype = _dtype_from_name(dtype_name)
        nbytes = _tensor_nbytes(shape, dtype)
        if shm_name:
            raw = self._from_shm(shm_name, nbytes)
        else:
            if not 0 < frame_index < len(self._in_frames):
                raise ValueError(f"tensor refers to frame {frame_index} of a {len(self._in_frames)}-frame message")
            buf = self._in_frames[frame_index].buffer
            if len(buf) != nbytes:
                raise ValueError(f"a tensor of shape {shape} and {dtype} needs {nbytes} bytes; its frame has {len(buf)}")
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            with warnings.catch_warnings():
                # zmq exposes received frames read-only; the frame is ours alone, so a
                # tensor over it (kept alive by the tensor) is safe to use as is.
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(buf, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    def _from_shm(self, name: str, nbytes: int) -> torch.Tensor:
        """Copy out (and unlink) a segment the sender made for us; refuse any other before opening it."""
        prefix = self.guard.accept_shm_prefix
        if prefix is None or not name.startswith(prefix) or not _SHM_NAME.fullmatch(name):
            where = "this link carries tensors inline only" if prefix is None else \
                f"its sender's segments are named {prefix}*"
            raise DroppedMessage("foreign_shm", f"a message names shared memory segment {name!r}, which is not "
                                                f"its sender's ({where}); the segment was left untouched")
        self._in_bytes += nbytes
        if self._in_bytes > self.guard.max_message_bytes:
            raise DroppedMessage("oversized", f"a message's tensors exceed --omni-max-message-bytes="
                                              f"{self.guard.max_message_bytes}")
        return _from_shm(name, nbytes)

    @staticmethod
    def _dec_hook(tp: type, obj: Any) -> Any:
        if tp is torch.Tensor and isinstance(obj, torch.Tensor):
            return obj
        raise TypeError(f"expected {tp.__name__}, got {type(obj).__name__}")


def _tensor_nbytes(shape: Any, dtype: torch.dtype) -> int:
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"a tensor shape must be a list of at most {_MAX_DIMS} sizes >= 0, got {shape!r}")
    return math.prod(shape) * dtype.itemsize


def _from_shm(name: str, nbytes: int) -> torch.Tensor:
    shm = shared_memory.SharedMemory(name=name)
    try:
        if shm.size < nbytes:
            raise ValueError(f"shared memory segment {name!r} has {shm.size} bytes; its tensor needs {nbytes}")
        view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes) if nbytes else None
        raw = view.clone() if view is not None else torch.empty(0, dtype=torch.uint8)  # must own its memory
        del view
    finally:
        shm.close()
        shm.unlink()
    return raw


def _unlink_shm(name: str) -> None:
    try:
        os.unlink(os.path.join(_SHM_DIR, name))
    except FileNotFoundError:
        return


def sweep_shared_memory(prefix: str) -> int:
    """Unlink segments left behind with `prefix` (a receiver that died before reading them)."""
    if not prefix or not os.path.isdir(_SHM_DIR):
        return 0
    removed = 0
    for name in os.listdir(_SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed += 1
            except FileNotFoundError:
                continue  # its receiver unlinked it meanwhile
    return removed


# --------------------------------------------------------------------------- addresses


def make_ipc_dir() -> str:
    # Short base dir: ipc:// paths are limited to ~107 bytes. The pid names the owner of a
    # folder left behind by a process that was killed.
    return tempfile.mkdtemp(prefix=f"vomni-{os.getpid()}-", dir="/tmp" if os.path.isdir("/tmp") else None)


def stage_addresses(ipc_dir: str, stage_id: int) -> tuple[str, str]:
    """(orchestrator -> worker, worker -> orchestrator) addresses of one stage."""
    return f"ipc://{ipc_dir}/stage{stage_id}-in", f"ipc://{ipc_dir}/stage{stage_id}-out"


def _configure(sock: zmq.Socket, linger_ms: int) -> None:
    # No high-water mark: a message is never dropped or blocked by zmq; the orchestrator
    # bounds what it has in flight itself.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def _bind_server(ctx: zmq.Context, sock: zmq.Socket, address: str, guard: LinkGuard,
                 socket_name: str) -> ConnectionWatch | None:
    """Bind a receiving socket under the guard: size cap; on tcp, CurveZMQ and a connection watch
    (which ends by itself when the socket closes)."""
    cap_size(sock, guard.max_message_bytes)
    if not _is_tcp(address):
        sock.bind(address)
        return None
    secure_server(sock, guard.keys)
    sock.bind(address)
    return ConnectionWatch(ctx, sock, guard.counter, socket_name, guard.stage)


def _connect_client(sock: zmq.Socket, address: str, guard: LinkGuard) -> None:
    if _is_tcp(address):
        secure_client(sock, guard.keys)
    sock.connect(address)


# --------------------------------------------------------------------------- worker side (sync)


class WorkerChannel:
    """The worker's two sockets: it receives ToWorker messages and sends FromWorker ones."""

    def __init__(self, ctx: zmq.Context, in_addr: str, out_addr: str | None, shm_threshold_bytes: int,
                 shm_prefix: str, guard: LinkGuard | None = None) -> None:
        self.guard = guard if guard is not None else LinkGuard()
        self.inbox = ctx.socket(zmq.PULL)
        self.outbox = ctx.socket(zmq.PUSH)
        # Outputs already produced are worth flushing on shutdown, for a bounded time.
        _configure(self.inbox, 0)
        _configure(self.outbox, 2000)
        try:
            # Bound before StageReady is sent, so the orchestrator's queue drains here.
            self._watch = _bind_server(ctx, self.inbox, in_addr, self.guard, "inbox")
            if out_addr is not None:
                self.connect_outbox(out_addr)
        except BaseException:  # an open socket would block the context's end
            self.close()
            raise
        self.codec = MessageCodec(ToWorker, shm_threshold_bytes, shm_prefix, self.guard)

    @property
    def inbox_endpoint(self) -> str:
        """The address the inbox is bound on (a `tcp://host:*` bind resolved to its port)."""
        return self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect_outbox(self, out_addr: str) -> None:
        """For a worker that learns where to send only after binding its inbox (a headless stage)."""
        _connect_client(self.outbox, out_addr, self.guard)

    def send(self, msg: Any) -> None:
        self.outbox.send_multipart(self.codec.encode(msg), copy=False)

    def recv(self, timeout_ms: int) -> Any | None:
        """The next message, waiting at most `timeout_ms` (0: only what is already queued).
        A message that is dropped (DroppedMessage) is counted and skipped."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self.inbox.poll(max(0, round((deadline - time.monotonic()) * 1000))):
            frames = self.inbox.recv_multipart(copy=False)
            try:
                return self.codec.decode(frames)
            except DroppedMessage as e:
                self.guard.drop("inbox", e)
        return None

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


# --------------------------------------------------------------------------- orchestrator side (asyncio)


class OrchestratorChannel:
    """The orchestrator's end of one stage, awaited by the stage client.

    Sending uses a plain (sync) socket: connected, with no high-water mark, a send only
    queues and never blocks the loop. Receiving uses an asyncio socket so the stage
    client awaits it.
    """

    def __init__(self, ctx: zmq.Context, in_addr: str, out_addr: str, shm_threshold_bytes: int,
                 shm_prefix: str, guard: LinkGuard | None = None) -> None:
        self.guard = guard if guard is not None else LinkGuard()
        self.to_worker = ctx.socket(zmq.PUSH)
        self.from_worker = zmq.asyncio.Context.shadow(ctx.underlying).socket(zmq.PULL)
        _configure(self.to_worker, 0)
        _configure(self.from_worker, 0)
        # Retry the connect quickly: the worker binds only once its process is up.
        self.to_worker.setsockopt(zmq.RECONNECT_IVL, 20)
        try:
            _connect_client(self.to_worker, in_addr, self.guard)
            self._watch = _bind_server(ctx, self.from_worker, out_addr, self.guard, "outputs")
        except BaseException:  # e.g. an address zmq refuses: an open socket would block the context's end
            self.close()
            raise
        self.codec = MessageCodec(FromWorker, shm_threshold_bytes, shm_prefix, self.guard)

    @property
    def out_port(self) -> int:
        """The port the worker's outputs come to (a `tcp://host:*` bind resolved)."""
        return int(self.from_worker.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def send_nowait(self, msg: Any) -> None:
        """Queue a message for the worker (NOBLOCK: a full queue would be an error, never a hang)."""
        self.to_worker.send_multipart(self.codec.encode(msg), flags=zmq.NOBLOCK, copy=False)

    async def recv(self, timeout_ms: int) -> Any | None:
        """The next message, or None when none arrived within `timeout_ms`. A message that is
        dropped (DroppedMessage) is counted and skipped: nothing a peer sends ends this reader.

        Waits with poll (which consumes nothing), so a timeout never cancels a read halfway.
        """
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left_ms = max(0, round((deadline - time.monotonic()) * 1000))
            if not await self.from_worker.poll(left_ms, zmq.POLLIN):
                # A timer and a ready socket can fire in the same loop iteration (e.g. after the
                # loop was busy); a message that is already queued is not a silent worker.
                if not self.from_worker.get(zmq.EVENTS) & zmq.POLLIN:
                    return None
            frames = await self.from_worker.recv_multipart(copy=False)
            try:
                return self.codec.decode(frames)
            except DroppedMessage as e:
                self.guard.drop("outputs", e)

    def close_sender(self) -> None:
        """Stop sending (and reconnecting) to a worker that is gone."""
        self.to_worker.close()

    def close(self) -> None:
        self.to_worker.close()
        self.from_worker.close()
