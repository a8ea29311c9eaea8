"""ZeroMQ CURVE for agents on tcp: the server proves its key, the agent accepts only listed keys, and
every frame is encrypted. A key folder (`serving_config.curve_keys`, or `LLM_SERVING_CURVE_KEYS`;
`python tools/curve_keys.py DIR` makes one) holds, on each host, what that host needs:

    agent.key, agent.key_secret     the agent's keypair (its host keeps the secret; servers: agent.key)
    server.key, server.key_secret   a server's keypair (its host keeps the secret)
    authorized/*.key                agent host: the public keys of the servers it accepts

An unlisted client never completes the handshake (ZAP refuses it in libzmq): none of its messages,
`r` included, reaches the agent. The agent also accepts its own key (its launcher's heartbeats).
Rotation: add the new server key to authorized/, restart the agents, switch the servers, remove the
old key, restart the agents again.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ENV = "LLM_SERVING_CURVE_KEYS"


class CurveKeyError(RuntimeError):
    """A key folder that lacks what this side needs (one line naming the file)."""


@dataclass(frozen=True)
class KeyFolder:
    path: Path

    @classmethod
    def find(cls, configured: str | None) -> "KeyFolder | None":
        folder = os.environ.get(ENV) or configured
        return cls(Path(folder).expanduser()) if folder else None

    def pair(self, name: str) -> tuple[bytes, bytes]:
        path = self.path / f"{name}.key_secret"
        if not path.is_file():
            raise CurveKeyError(f"CURVE: {path} not found (make keys with `python tools/curve_keys.py {self.path}`)")
        public, secret = zmq.auth.load_certificate(str(path))
        return public, secret

    def public(self, name: str) -> bytes:
        path = self.path / f"{name}.key"
        if not path.is_file():
            raise CurveKeyError(f"CURVE: {path} not found (copy the agent host's {name}.key here)")
        return zmq.auth.load_certificate(str(path))[0]

    def client(self, sock: zmq.Socket, as_agent: bool = False) -> None:
        """A server's (or, `as_agent`, the agent's own launcher's) socket to an agent. The launcher
        needs only what its host's agents do (agent.key_secret holds the public key too)."""
        public, secret = self.pair("agent" if as_agent else "server")
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = public if as_agent else self.public("agent")

    def serve(self, ctx: zmq.Context, sock: zmq.Socket) -> ThreadAuthenticator:
        """The agent's socket: CURVE server, clients limited to authorized/ and its own key."""
        public, secret = self.pair("agent")
        allowed = self.path / "authorized"
        if not any(allowed.glob("*.key")):
            raise CurveKeyError(f"CURVE: no server key in {allowed}: add the servers' server.key files there")
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(allowed))
        auth.certs["*"][public] = b"OK"  # the launcher's heartbeats come with the agent's own key
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret
        return auth


INSECURE_ENV = "LLM_SERVING_INSECURE"


def exposure(agent_ip: str, keys: KeyFolder | None, insecure: bool) -> tuple[str | None, str | None]:
    """(refusal, warning) for an agent about to listen on `agent_ip`: plain tcp beyond loopback is
    refused unless `insecure` (then warned about at every start)."""
    if keys is not None or loopback(agent_ip):
        return None, None
    why = (f"agent_ip {agent_ip} is not a loopback address and no CURVE keys are configured: anyone who "
           "reaches the port could send `r` and steps and read the tokens")
    if insecure:
        return None, f"{why}; serving anyway (--insecure)"
    return f"{why}; set serving_config.curve_keys (tools/curve_keys.py) or pass --insecure", None


def loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or a name resolving to one."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False
