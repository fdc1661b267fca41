"""The stage transport's guards, in one process over loopback TCP (issue 41): the cluster secret
(where it comes from, what it refuses), CurveZMQ on the registration socket (a peer without the
secret learns nothing and a headless replica so refused knows at once), garbage and oversized
messages dropped and counted, the registration rate limit and replica cap, a reader that survives
what a peer sends. The real processes are in test_secure_cluster.py."""
from __future__ import annotations

import os
import socket
import time

import msgspec
import pytest
import zmq

from tests.headless.test_registration import INBOX, SUMMARY, Head, attach
from tests.pipeline.conftest import wait_until
from tests.server.conftest import free_port
from vllm_omni.engine.cluster_secret import SECRET_ENV, CurveKeys, load_cluster_keys
from vllm_omni.engine.messages import Heartbeat
from vllm_omni.engine.registration import Accepted, MasterLink, Refused, Register, RegistrationRefused, encode
from vllm_omni.engine.stage_client import StageState
from vllm_omni.engine.stage_master import MasterLimits
from vllm_omni.engine.transport import MessageCodec
from vllm_omni.engine.transport_guard import secure_client
from vllm_omni.entrypoints.cli import stage_cli
from vllm_omni.entrypoints.cli.main import main

SECRET = "correct-horse-battery-staple-0123456789"
KEYS = CurveKeys.from_secret(SECRET)
WRONG = CurveKeys.from_secret("another-secret-of-enough-length")


def drops(head: Head) -> dict[tuple[str, str, str], int]:
    return {(k.socket, k.stage, k.reason): n for k, n in head.master.drops.snapshot().items()}


@pytest.fixture
def secure_head():
    h = Head(free_port(), MasterLimits(keys=KEYS))
    h.call(h.master.start())
    yield h
    h.close()


@pytest.fixture
def worker_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


# ------------------------------------------------------------------ the secret


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert load_cluster_keys(None) is None
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert load_cluster_keys(None) == KEYS
    path = tmp_path / "secret"
    path.write_text(f"{SECRET}\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"has mode 0644: group and others may read it.*chmod 600"):
        load_cluster_keys(str(path))
    path.chmod(0o600)
    monkeypatch.setenv(SECRET_ENV, "another-secret-of-enough-length")
    assert load_cluster_keys(str(path)) == KEYS  # the file named on the command line wins
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        load_cluster_keys(str(path))
    # Two key pairs, both fixed by the secret alone: every process derives the same ones.
    assert len({KEYS.server_public, KEYS.client_public, WRONG.server_public, WRONG.client_public}) == 4
    assert zmq.curve_public(KEYS.server_secret) == KEYS.server_public


# Should a check regress, these commands would start for real: the timeouts make them fail fast.
FAIL_FAST = ["--init-timeout", "1", "--stage-init-timeout", "1", "--port", "0"]


@pytest.mark.parametrize("argv, message", [
    (["--stage-id", "0", "-oma", "0.0.0.0", "-omp", "26000"],
     "refusing to listen for stage traffic on 0.0.0.0 (--omni-master-address) without a cluster secret"),
    (["--headless", "--stage-id", "1", "-oma", "127.0.0.1", "-omp", "26000", "-ora", "0.0.0.0"],
     "refusing to listen for stage traffic on 0.0.0.0 (--omni-replica-address) without a cluster secret"),
])
def test_stages_listen_beyond_loopback_only_with_a_secret(capsys, monkeypatch, argv, message):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert main(["serve", *argv, *FAIL_FAST]) == 2
    err = capsys.readouterr().err
    assert message in err and SECRET_ENV in err and "--omni-secret-file" in err
    monkeypatch.setenv(SECRET_ENV, SECRET)  # with one, the same flags pass the check
    parser = __import__("argparse").ArgumentParser()
    from vllm_omni.entrypoints.cli import serve_args

    serve_args.add_arguments(parser)
    assert stage_cli.problems(parser.parse_args(argv)) == []


def test_a_secret_file_others_can_read_is_refused_at_startup(capsys, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o640)
    argv = ["serve", "--stage-id", "0", "-oma", "127.0.0.1", "-omp", "26000", "--omni-secret-file", str(path)]
    assert main([*argv, *FAIL_FAST]) == 2
    assert "has mode 0640" in capsys.readouterr().err


# ------------------------------------------------------------------ who gets in


def test_only_a_peer_with_the_secret_registers_and_a_refused_one_knows_at_once(secure_head, worker_ctx):
    link = MasterLink.register(worker_ctx, attach(secure_head.port, keys=KEYS), 1, INBOX, timeout_s=10.0)
    assert link.accepted.replica == 0
    link.close("stopped")
    for keys, says in ((WRONG, "the encrypted handshake with the head at"),
                       (None, "it requires a cluster secret and this process has none")):
        t0 = time.monotonic()
        with pytest.raises(RegistrationRefused, match=says) as e:
            MasterLink.register(worker_ctx, attach(secure_head.port, keys=keys), 1, INBOX, timeout_s=120.0)
        assert time.monotonic() - t0 < 10.0  # at once, not after its registration timeout
        assert SUMMARY not in str(e.value) and "VLLM_OMNI_SECRET" in str(e.value)
    # A peer that knows the server's public key but not the client's secret key: ZAP refuses it.
    stolen = CurveKeys(KEYS.server_public, KEYS.server_secret, WRONG.client_public, WRONG.client_secret)
    with pytest.raises(RegistrationRefused, match="refused this process's key"):
        MasterLink.register(worker_ctx, attach(secure_head.port, keys=stolen), 1, INBOX, timeout_s=120.0)
    assert len(secure_head.pools[1].replicas) == 1  # none of them was registered
    assert wait_until(lambda: drops(secure_head).get(("registration", "", "handshake_failed"), 0) >= 3, 5.0)


def test_a_peer_without_the_secret_sees_nothing(secure_head, worker_ctx):
    plain = worker_ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(f"tcp://127.0.0.1:{secure_head.port}")
    plain.send(encode(Register(1, INBOX, "h", 1, "f", SUMMARY)))
    assert not plain.poll(1500)  # no answer, no refusal, nothing about the pipeline
    with socket.create_connection(("127.0.0.1", secure_head.port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 65536)
        seen = b""
        try:
            while chunk := raw.recv(4096):
                seen += chunk
        except ConnectionResetError:
            pass  # it hung up on us
    assert len(seen) <= 64 and b"thinker" not in seen  # at most ZMQ's greeting, then it hangs up
    assert wait_until(lambda: drops(secure_head).get(("registration", "", "not_zmtp"), 0) >= 1
                      and drops(secure_head).get(("registration", "", "handshake_failed"), 0) >= 1, 5.0)


# ------------------------------------------------------------------ what gets dropped


def test_garbage_and_oversized_messages_to_the_registration_socket_are_dropped(worker_ctx):
    head = Head(free_port())  # loopback, no secret: anything local may connect
    head.call(head.master.start())
    try:
        peer = worker_ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(f"tcp://127.0.0.1:{head.port}")
        peer.send(b"\x01")
        peer.send_multipart([b"a", b"b", b"c"])
        peer.send(b"\x00" * (8 << 20))  # over the socket's 64 KiB: ZMQ cuts the connection, nothing is read
        assert wait_until(lambda: drops(head).get(("registration", "", "undecodable"), 0) == 2, 5.0)
        link = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=10.0)  # still serving
        link.close("stopped")
        assert not peer.poll(200)
    finally:
        head.close()


def test_a_registration_flood_is_rate_limited_and_capped_and_a_real_stage_still_gets_in(worker_ctx):
    head = Head(free_port(), MasterLimits(keys=KEYS, max_replicas_per_stage=4, registration_rate=20.0))
    head.call(head.master.start())
    try:
        flood = worker_ctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        secure_client(flood, KEYS)  # the worst case: a peer that has the secret
        flood.connect(f"tcp://127.0.0.1:{head.port}")
        for _ in range(300):
            flood.send(encode(Register(1, INBOX, "h", 1, head.master.fingerprint, SUMMARY)))
        replies = []
        while len(replies) < 300 and flood.poll(5000):
            replies.append(msgspec.msgpack.decode(flood.recv(), type=Accepted | Refused))
        accepted = [r for r in replies if isinstance(r, Accepted)]
        assert len(replies) == 300 and len(accepted) == 4  # the cap
        assert all(r.retry_after_s is not None for r in replies if isinstance(r, Refused))
        counts = drops(head)
        assert counts[("registration", "", "rate_limited")] >= 250 and counts[("registration", "1", "replica_cap")] >= 1
        # The flood's replicas never send a heartbeat: they are down after the hang deadline (3 s
        # here), long before their stage_init_timeout (30 s), and a real stage, retrying, takes a slot.
        link = MasterLink.register(worker_ctx, attach(head.port, keys=KEYS), 1, INBOX, timeout_s=20.0)
        assert link.accepted.replica < 4 and len(head.pools[1].replicas) == 4
        link.close("stopped")
    finally:
        head.close()


def test_one_byte_to_a_replica_output_port_does_not_stop_its_reader(worker_ctx):
    head = Head(free_port(), MasterLimits(keys=KEYS))
    head.call(head.master.start())
    try:
        link = MasterLink.register(worker_ctx, attach(head.port, keys=KEYS), 1, INBOX, timeout_s=10.0)
        client = head.pools[1].replicas[0]
        out = worker_ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        secure_client(out, KEYS)
        out.connect(link.out_addr)
        out.send(b"\x01")
        out.send_multipart([b"\x92\x01", b"junk"])
        assert wait_until(lambda: drops(head).get(("outputs", "1", "undecodable"), 0) == 2, 5.0)
        assert client.health().seconds_since_heard is None
        out.send_multipart(MessageCodec(Heartbeat, 1 << 20, "").encode(Heartbeat(1, os.getpid())))
        assert wait_until(lambda: client.health().seconds_since_heard is not None, 5.0)  # still reading
        assert client.state == StageState.STARTING
        stranger = worker_ctx.socket(zmq.PUSH)  # no secret: its connection fails, its message is never read
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(link.out_addr)
        stranger.send(b"\x01")
        assert wait_until(lambda: drops(head).get(("outputs", "1", "handshake_failed"), 0) >= 1, 5.0)
        assert drops(head)[("outputs", "1", "undecodable")] == 2
        link.close("stopped")
    finally:
        head.close()


def test_a_registration_reader_that_dies_takes_its_replicas_down(worker_ctx):
    head = Head(free_port())
    head.call(head.master.start())
    try:
        link = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=10.0)
        client = head.pools[1].replicas[0]
        head.on_loop(head.master._task.cancel)  # as if it had died: nothing answers pings any more
        assert wait_until(lambda: client.state == StageState.DOWN, 5.0)
        assert client.reason == "the head's registration socket failed: its reader was cancelled"
        link.close("stopped")
    finally:
        head.close()


def test_a_registration_that_cannot_be_attached_holds_no_slot(worker_ctx):
    head = Head(free_port(), MasterLimits(max_replicas_per_stage=1))
    head.call(head.master.start())
    try:
        for _ in range(3):  # an inbox zmq cannot connect to: refused, and the stage's one slot stays free
            with pytest.raises(RegistrationRefused, match="could not attach it"):
                MasterLink.register(worker_ctx, attach(head.port), 1, "tcp://no port", timeout_s=10.0)
        link = MasterLink.register(worker_ctx, attach(head.port), 1, INBOX, timeout_s=10.0)
        assert link.accepted.replica == 0
        link.close("stopped")
    finally:
        head.close()
