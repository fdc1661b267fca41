"""The cluster secret: what a head and its headless stages share to trust each other over TCP.

Every process of a stage-based deployment is given the same secret, in the environment variable
`VLLM_OMNI_SECRET` or in a file named by `--omni-secret-file` (readable by its owner only). From
it each derives the same two CurveZMQ key pairs (HKDF-SHA256, one label per pair): the *server*
pair of every socket that binds and the *client* pair of every socket that connects. A server
accepts a connection only from the client key (checked by a ZAP handler, transport_guard.py),
and a client that does not know the server's public key cannot even start the handshake; so a
peer without the secret sees nothing, and every TCP link is encrypted with keys made fresh per
connection. docs/operations.md ("Security: the stage transport") says why CurveZMQ and not TLS.

Without a secret, stages may only listen on loopback addresses (`require_secret_to_listen`).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

SECRET_ENV = "VLLM_OMNI_SECRET"
SECRET_FLAG = "--omni-secret-file"
# A secret this short could be guessed offline from one recorded handshake; token_urlsafe(32)
# (the documented way to make one) gives 43 characters.
MIN_SECRET_CHARS = 16
_SALT = b"vllm-omni cluster secret v1"
HOW_TO_SET = (f"set the same secret on the head and every headless command: the environment variable "
              f"{SECRET_ENV} or {SECRET_FLAG} PATH (a file of mode 0600); make one with "
              "python -c 'import secrets; print(secrets.token_urlsafe(32))'")


@dataclass(frozen=True)
class CurveKeys:
    """The two CurveZMQ key pairs derived from a cluster secret (z85-encoded, as zmq takes them)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        server_secret = z85.encode(_hkdf_sha256(secret.encode(), b"curve server key"))
        client_secret = z85.encode(_hkdf_sha256(secret.encode(), b"curve client key"))
        return cls(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def _hkdf_sha256(secret: bytes, label: bytes) -> bytes:
    """RFC 5869 HKDF with SHA-256, 32 bytes out (one expand block): a Curve25519 secret key."""
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


def load_cluster_keys(secret_file: str | None) -> CurveKeys | None:
    """The keys of the secret in `secret_file` (when given) or in $VLLM_OMNI_SECRET; None without
    either. Raises ValueError naming the problem: a file others may read, an empty or short secret."""
    if secret_file is not None:
        secret = _read_secret_file(secret_file)
        where = f"{SECRET_FLAG} {secret_file}"
    else:
        secret = os.environ.get(SECRET_ENV)
        if secret is None:
            return None
        secret = secret.strip()
        where = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the cluster secret in {where} is {len(secret)} characters long; it must have at least "
                         f"{MIN_SECRET_CHARS} (make one with python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))')")
    return CurveKeys.from_secret(secret)


def _read_secret_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ValueError(f"{SECRET_FLAG} {path}: cannot open it: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{SECRET_FLAG} {path}: not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ValueError(f"{SECRET_FLAG} {path} has mode {mode:04o}: group and others may read it; the "
                             f"secret file must be readable by its owner only (chmod 600 {path})")
        data = f.read(4096)
    try:
        return data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{SECRET_FLAG} {path}: the secret must be text (UTF-8)") from None


# --------------------------------------------------------------------------- where a stage may listen


def is_loopback(host: str) -> bool:
    """Whether every address `host` stands for is a loopback address (0.0.0.0 is not: it is every
    interface). A name that does not resolve is not known to be loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def listen_problem(host: str, keys: CurveKeys | None, flag: str) -> str | None:
    """Why a stage transport may not listen on `host` (named by `flag`): only loopback without a secret."""
    if keys is not None or is_loopback(host):
        return None
    return (f"refusing to listen for stage traffic on {host} ({flag}) without a cluster secret: anyone who can reach "
            f"that address could join the pipeline and read its requests. Use a loopback address, or {HOW_TO_SET}")


def require_secret_to_listen(host: str, keys: CurveKeys | None, flag: str) -> None:
    problem = listen_problem(host, keys, flag)
    if problem is not None:
        raise ValueError(problem)
