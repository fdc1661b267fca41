"""The head's side of the stage-based CLI: headless replicas register here and join a StagePool.

`StageMaster` binds the registration socket (`--omni-master-address/--omni-master-port`), checks
each registration's pipeline fingerprint (registration.py), connects to the replica's inbox, binds
a port for its outputs, and adds it to its stage's pool as a replica like any other: routed by the
policy at once, marked DOWN by missed heartbeats. The head does not restart a headless replica (it
has nothing to start it with): a replica that goes down stays down until a process registers
again, which takes the slot of a down headless replica of that stage (else a new slot).

What it lets in: only peers that hold the cluster secret (CurveZMQ on every socket; without a
secret it listens on loopback only, cluster_secret.py), at most `registration_rate` registrations
per second and `max_replicas_per_stage` replicas per stage (both answered "try again later"), and
messages of at most CONTROL_MAX_BYTES. A refusal names no detail of the head's pipeline: its log
does. A registered replica must send heartbeats from the start (stage_client.py), so one that
registers and goes quiet frees its slot after the hang deadline.

`RemoteLauncher` is the StageLauncher of such a replica: nothing to launch or kill here.
"kill" evicts it (its next ping is answered "unknown", and it exits); it is gone when it says
so (Leave) or stops sending heartbeats.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from vllm_omni.engine.cluster_secret import CurveKeys, require_secret_to_listen
from vllm_omni.engine.registration import (
    CONTROL_MAX_BYTES, TO_MASTER, Accepted, Leave, Ping, Pong, Refused, Register, bind_address, encode,
    pipeline_fingerprint, tcp,
)
from vllm_omni.engine.replica_pool import StagePool
from vllm_omni.engine.stage_client import StageClient, StageState
from vllm_omni.engine.stage_launcher import OnExit
from vllm_omni.engine.transport import INLINE_ONLY, LinkGuard, OrchestratorChannel
from vllm_omni.engine.transport_guard import (
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_REPLICAS_PER_STAGE, DEFAULT_REGISTRATION_RATE, ConnectionWatch, DropCounter,
    DropKey, cap_size, secure_server,
)

logger = logging.getLogger(__name__)

# (stage id, replica, launcher, channel) -> the started-to-be client, wired to the orchestrator.
MakeClient = Callable[[int, int, "RemoteLauncher", OrchestratorChannel], StageClient]


@dataclass(frozen=True)
class MasterLimits:
    """Who the registration socket lets in, and how many (the head's --omni-* flags)."""

    keys: CurveKeys | None = field(default=None, repr=False)  # the cluster secret's (None: loopback only)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # of a registered replica's outputs
    max_replicas_per_stage: int = DEFAULT_MAX_REPLICAS_PER_STAGE
    registration_rate: float = DEFAULT_REGISTRATION_RATE

    def __post_init__(self) -> None:
        if self.max_replicas_per_stage < 1:
            raise ValueError(f"max_replicas_per_stage={self.max_replicas_per_stage} must be >= 1")
        if self.registration_rate <= 0:
            raise ValueError(f"registration_rate={self.registration_rate} must be > 0")


class TokenBucket:
    """`rate` events per second on average, `rate` (at least 1) at once."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self._tokens = self.capacity
        self._at = time.monotonic()

    def take(self) -> float | None:
        """None: allowed (one token taken); else seconds until the next token."""
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return (1.0 - self._tokens) / self.rate


class RemoteLauncher:
    """A headless replica, started by its operator on some host; it tells us when it leaves."""

    def __init__(self, master: StageMaster, session: str, reg: Register) -> None:
        self.master = master
        self.session = session
        self.pid: int | None = reg.pid
        self.host = reg.host
        self._left = asyncio.Event()
        self._on_exit: OnExit | None = None

    def start(self, on_exit: OnExit) -> None:
        self._on_exit = on_exit

    def left(self, reason: str) -> None:
        self._left.set()
        if self._on_exit is not None:
            self._on_exit(f"headless replica (pid {self.pid} on {self.host}) left: {reason}")

    async def stop(self, timeout_s: float, graceful: bool) -> None:
        if graceful:  # Shutdown was sent: it answers with Leave on its way out
            try:
                await asyncio.wait_for(self._left.wait(), timeout_s)
            except asyncio.TimeoutError:
                logger.warning("headless replica pid %s on %s did not leave within %ss", self.pid, self.host, timeout_s)
        self.kill()

    def kill(self) -> None:
        self.master.evict(self.session)

    def stop_blocking(self, timeout_s: float) -> None:
        return  # another host's process: its pings go unanswered and it exits on its own


class StageMaster:
    def __init__(self, ctx: zmq.Context, address: str, port: int, model: str, summary: str,
                 pools: dict[int, StagePool], make_client: MakeClient, *, heartbeat_interval_s: float,
                 heartbeat_timeout_s: float, stage_init_timeout_s: float, limits: MasterLimits | None = None,
                 drops: DropCounter | None = None) -> None:
        self.limits = limits if limits is not None else MasterLimits()
        self.host = bind_address(address)
        require_secret_to_listen(self.host, self.limits.keys, "--omni-master-address")
        self.drops = drops if drops is not None else DropCounter()
        self._bucket = TokenBucket(self.limits.registration_rate)
        self.port = port
        self.summary = summary  # registration.pipeline_summary of the head's pipeline
        self.fingerprint = pipeline_fingerprint(summary)
        self._command = (f"`vllm-omni serve {model} --headless --stage-id {{stage_id}} "
                         f"--omni-master-address {address} --omni-master-port {port}`")
        self.pools = pools
        self._make_client = make_client
        self._ctx = ctx
        self._heartbeats = (heartbeat_interval_s, heartbeat_timeout_s)
        self._stage_init_timeout_s = stage_init_timeout_s
        self._sessions: dict[str, RemoteLauncher] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._waits: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        """Bind the registration socket. With keys, the context's ZAP handler must be running
        (transport_guard.ZapGuard), else ZMQ lets any client key in."""
        sock = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        cap_size(sock, CONTROL_MAX_BYTES)
        secure_server(sock, self.limits.keys)
        try:
            sock.bind(tcp(self.host, self.port))
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(f"cannot listen for headless stages on {tcp(self.host, self.port)} "
                               f"(--omni-master-address/--omni-master-port): {e}") from None
        self._sock = sock
        ConnectionWatch(self._ctx, sock, self.drops, "registration", "")
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="stage master")
        self._task.add_done_callback(self._served)
        logger.info("waiting for headless stages on %s (%s)", tcp(self.host, self.port),
                    "CurveZMQ with the cluster secret" if self.limits.keys is not None else "loopback, no secret")

    async def wait_for_stages(self, stage_ids: list[int], deadline: float, what: str) -> None:
        """Until every stage in `stage_ids` has an UP replica; TimeoutError naming the missing ones."""
        while missing := [sid for sid in stage_ids if not self.pools[sid].is_up]:
            if time.monotonic() >= deadline:
                names = ", ".join(self.pools[sid].name for sid in missing)
                raise TimeoutError(f"no headless replica of {names} came up within {what}; start each with "
                                   + "; ".join(self._command.format(stage_id=sid) for sid in missing))
            await asyncio.sleep(0.1)

    def is_remote(self, client: StageClient | None) -> bool:
        return client is not None and isinstance(client.launcher, RemoteLauncher)

    def evict(self, session: str) -> None:
        self._sessions.pop(session, None)

    async def close(self) -> None:
        self._closing = True
        for task in (self._task, *self._waits):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._waits) if t is not None), return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # --- the registration socket ---------------------------------------------
    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames) - 1} message frames instead of one")
                msg = TO_MASTER.decode(frames[1])
            except ValueError as e:  # msgspec's errors too: anything may connect to a TCP port
                self._drop("undecodable", f"a message that is not a registration message: {e}")
                continue
            try:
                await self._handle(frames[0], msg)
            except Exception:  # noqa: BLE001 - one message's failure (a bug) must not end the socket
                logger.exception("the registration socket could not handle a %s", type(msg).__name__)

    def _served(self, task: asyncio.Task[None]) -> None:
        """Only close() ends the registration reader; if anything else does (a bug, a stray cancel),
        its replicas can no longer be pinged: they are marked down, and /health says why, instead
        of failing later, silently."""
        if self._closing:
            return
        error = None if task.cancelled() else task.exception()
        reason = "the head's registration socket failed: " + (f"{type(error).__name__}: {error}" if error is not None
                                                              else "its reader was cancelled")
        logger.error("%s", reason, exc_info=error)
        for pool in self.pools.values():
            for client in pool.clients():
                if self.is_remote(client):
                    client.mark_down(reason)

    def _drop(self, reason: str, detail: str, stage: str = "") -> None:
        self.drops.drop(DropKey("registration", stage, reason), detail)

    async def _handle(self, identity: bytes, msg: Register | Ping | Leave) -> None:
        if isinstance(msg, Ping):
            await self._reply(identity, Pong(known=msg.session in self._sessions))
        elif isinstance(msg, Leave):
            launcher = self._sessions.pop(msg.session, None)
            if launcher is not None:
                launcher.left(msg.reason)
        else:
            try:
                answer = await self._register(msg)
            except Exception as e:  # noqa: BLE001 - e.g. an inbox address zmq cannot connect to: refuse it
                logger.exception("a headless stage %d could not be attached", msg.stage_id)
                answer = Refused(f"the head could not attach it: {type(e).__name__}: {e}")
            await self._reply(identity, answer)

    async def _reply(self, identity: bytes, msg: Accepted | Refused | Pong) -> None:
        assert self._sock is not None
        await self._sock.send_multipart([identity, encode(msg)])

    async def _register(self, reg: Register) -> Accepted | Refused:
        where = f"pid {reg.pid} on {reg.host}"
        wait_s = self._bucket.take()
        if wait_s is not None:
            self._drop("rate_limited", f"a registration beyond --omni-registration-rate="
                                       f"{self.limits.registration_rate}/s ({where}, stage {reg.stage_id})")
            return Refused(f"registrations come faster than the head takes them (--omni-registration-rate "
                           f"{self.limits.registration_rate}/s)", retry_after_s=wait_s + 0.05)
        problem = self._refusal(reg)
        if problem is not None:
            logger.error("refused a headless stage %d (%s): %s", reg.stage_id, where, problem)
            return Refused(problem)
        pool = self.pools[reg.stage_id]
        replica = self._free_slot(pool)
        if replica is None:
            self._drop("replica_cap", f"stage {reg.stage_id} has {pool.num_replicas} replicas, the most "
                                      f"--omni-max-replicas-per-stage allows ({where})", str(reg.stage_id))
            return Refused(f"stage {reg.stage_id} has its maximum of {self.limits.max_replicas_per_stage} replicas "
                           "(--omni-max-replicas-per-stage), none of them down", retry_after_s=self._heartbeats[1])
        guard = LinkGuard(keys=self.limits.keys, max_message_bytes=self.limits.max_message_bytes,
                          counter=self.drops, stage=str(reg.stage_id))
        channel = OrchestratorChannel(self._ctx, reg.inbox, tcp(self.host, "*"), INLINE_ONLY, "", guard)
        await self._take_slot(pool, replica)  # only now: a registration that fails above holds no slot
        session = uuid.uuid4().hex
        launcher = RemoteLauncher(self, session, reg)
        client = self._make_client(reg.stage_id, replica, launcher, channel)
        self._sessions[session] = launcher
        client.start()
        logger.info("%s: headless replica registered (%s, inbox %s, its outputs to port %d)", client.name, where,
                    reg.inbox, channel.out_port)
        wait = asyncio.get_running_loop().create_task(self._await_ready(client), name=f"{client.name} ready")
        self._waits.add(wait)
        wait.add_done_callback(self._waits.discard)
        interval, timeout = self._heartbeats
        return Accepted(session, replica, channel.out_port, interval, timeout)

    def _refusal(self, reg: Register) -> str | None:
        if self._closing:
            return "the head is shutting down"
        if reg.stage_id not in self.pools:
            return f"the head's pipeline has no stage {reg.stage_id} (stages {sorted(self.pools)})"
        if not reg.inbox.startswith("tcp://"):
            return f"its inbox {reg.inbox!r} is not a tcp:// address"
        if reg.fingerprint != self.fingerprint:
            # Only the head's log shows the head's pipeline: a refusal tells the peer nothing about it.
            logger.error("headless stage %d has another pipeline config:\n  head:  %s\n  stage: %s", reg.stage_id,
                         self.summary, reg.summary)
            return ("its pipeline config differs from the head's: start both with the same MODEL and config file "
                    "(the head's log shows both pipelines)")
        return None

    def _free_slot(self, pool: StagePool) -> int | None:
        """The slot of a headless replica of this stage that went down, else a new one (None: the
        stage has its maximum of replicas)."""
        for replica, client in enumerate(pool.replicas):
            # A silent one too: if it speaks again, its session is gone and it exits.
            if self.is_remote(client) and client.state in (StageState.DOWN, StageState.STOPPED):
                return replica
        return pool.num_replicas if pool.num_replicas < self.limits.max_replicas_per_stage else None

    async def _take_slot(self, pool: StagePool, replica: int) -> None:
        if replica == pool.num_replicas:
            pool.replicas.append(None)
            return
        old = pool.replicas[replica]
        assert old is not None
        await old.close(0.0)  # its reader and sockets

    async def _await_ready(self, client: StageClient) -> None:
        limit = self._stage_init_timeout_s
        try:
            await client.wait_ready(time.monotonic() + limit, f"stage_init_timeout={limit}s")
        except TimeoutError as e:
            client.mark_down(str(e))
        except RuntimeError:
            return  # it failed to start: already marked down, with the reason
