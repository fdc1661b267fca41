"""The head's side of the stage-based CLI: headless replicas register here and join a StagePool.

`StageMaster` binds the registration socket (`--omni-master-address/--omni-master-port`), checks
each registration's pipeline fingerprint (registration.py), connects to the replica's inbox, binds
a port for its outputs, and adds it to its stage's pool as a replica like any other: routed by the
policy at once, marked DOWN by missed heartbeats. The head does not restart a headless replica (it
has nothing to start it with): a replica that goes down stays down until a process registers
again, which takes the slot of a down headless replica of that stage (else a new slot).

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

import zmq
import zmq.asyncio

from vllm_omni.engine.registration import (
    TO_MASTER, Accepted, Leave, Ping, Pong, Refused, Register, bind_address, encode, pipeline_fingerprint, tcp,
)
from vllm_omni.engine.replica_pool import StagePool
from vllm_omni.engine.stage_client import StageClient, StageState
from vllm_omni.engine.stage_launcher import OnExit
from vllm_omni.engine.transport import INLINE_ONLY, OrchestratorChannel

logger = logging.getLogger(__name__)

# (stage id, replica, launcher, channel) -> the started-to-be client, wired to the orchestrator.
MakeClient = Callable[[int, int, "RemoteLauncher", OrchestratorChannel], StageClient]


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
                 heartbeat_timeout_s: float, stage_init_timeout_s: float) -> None:
        self.host = bind_address(address)
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
        sock = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(tcp(self.host, self.port))
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(f"cannot listen for headless stages on {tcp(self.host, self.port)} "
                               f"(--omni-master-address/--omni-master-port): {e}") from None
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="stage master")
        logger.info("waiting for headless stages on %s", tcp(self.host, self.port))

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
            identity, payload = await self._sock.recv_multipart()
            try:
                msg = TO_MASTER.decode(payload)
            except Exception as e:  # noqa: BLE001 - anything may connect to a TCP port: ignore what is not ours
                logger.warning("ignored a message on the registration socket that is not ours: %s", e)
                continue
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
        problem = self._refusal(reg)
        if problem is not None:
            logger.error("refused a headless stage %d (%s): %s", reg.stage_id, where, problem)
            return Refused(problem)
        channel = OrchestratorChannel(self._ctx, reg.inbox, tcp(self.host, "*"), INLINE_ONLY, "")
        replica = await self._free_slot(self.pools[reg.stage_id])
        session = uuid.uuid4().hex
        launcher = RemoteLauncher(self, session, reg)
        client = self._make_client(reg.stage_id, replica, launcher, channel)
        self._sessions[session] = launcher
        client.start()
        logger.info("%s: headless replica registered (%s, inbox %s)", client.name, where, reg.inbox)
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
        if reg.fingerprint != self.fingerprint:
            return (f"its pipeline config differs from the head's: start both with the same MODEL and config "
                    f"file.\n  head:  {self.summary}\n  stage: {reg.summary}")
        return None

    async def _free_slot(self, pool: StagePool) -> int:
        """The slot of a headless replica of this stage that went down, else a new one."""
        for replica, client in enumerate(pool.replicas):
            if self.is_remote(client) and client.state in (StageState.DOWN, StageState.STOPPED):
                await client.close(0.0)  # its reader and sockets
                return replica
        pool.replicas.append(None)
        return pool.num_replicas - 1

    async def _await_ready(self, client: StageClient) -> None:
        limit = self._stage_init_timeout_s
        try:
            await client.wait_ready(time.monotonic() + limit, f"stage_init_timeout={limit}s")
        except TimeoutError as e:
            client.mark_down(str(e))
        except RuntimeError:
            return  # it failed to start: already marked down, with the reason
