"""Peer authentication: a mutual challenge–response on the first frames of every data-plane connection.

The shared secret (a plan's token on the transfer port, the installation token on the activation port)
never crosses the wire. Each side proves it holds it by a keyed MAC over fresh nonces, so a listener that
is not a peer (an address a request named in `X-Kascade-Prefill`, a stale plan address now reused)
learns nothing it can use: not the token, and no answer it could replay (every server nonce is fresh).

  S -> C  {"op": "challenge", "v": 1, "nonce"}                              (server speaks first)
  C -> S  {"op": "hello", "nonce", "proof", "claims": {"to", ...}}         (client's nonce and proof)
  S -> C  {"op": "welcome", "proof"}  or  {"op": "error", "message"}       (server's proof)

proof = HMAC-SHA256(token, "kascade-peerauth-v1" | side | context | server nonce | client nonce | claims)
with `side` "client" or "server" (one side's proof is never valid as the other's), `context` naming
the channel ("transfer", "activation": a proof for one is not one for the other) and `claims` the
client's canonical JSON (who it is, what it asks for: a man in the middle cannot change them).

Relaying: a rogue listener R that forwards a real server's challenge to a client and the client's answer
back would get an authenticated connection to the server. The client's claims therefore name the address
it connected to (`to`, as its socket sees it) and a server that knows its own socket address refuses a
proof made for another one: R's relayed answer names R, not the server. Over UCX too: an accepted UCX
connection's `local` is the address UCP says the client reached (transport_ucx), which matters since a
decode engine dials the prefill address a request names over --transport ucx as well. A transport that
cannot tell (`local` None) leaves only the nonces. Mutual TLS (`transport_tls`) additionally encrypts
everything after.

Frames here carry no payload (`max_payload=0`): nothing is allocated before authentication. Every
failure is an `AuthError` whose message says which side refused and why, and the server logs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from kascade_engine.net.transport import Connection, Header, TransportError

log = logging.getLogger(__name__)

VERSION = 1
NONCE_BYTES = 32
_LABEL = b"kascade-peerauth-v1"
# A server waits at most this long for a client's hello, whatever the caller's (plan's) timeout: a real peer
# answers the challenge in milliseconds, and a stranger must not hold a connection slot for minutes.
HANDSHAKE_TIMEOUT_S = 5.0


class AuthError(TransportError):
    """Authentication of a data-plane connection failed (wrong token, not a peer, relayed, malformed)."""


def _hex(v: Any, name: str, n: int) -> bytes:
    if not isinstance(v, str) or len(v) != 2 * n:
        raise AuthError(f"field {name!r} must be {2 * n} hex characters")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise AuthError(f"field {name!r} is not hex") from None


def normal_address(addr: str | None) -> str | None:
    """"host:port" with an IPv4-mapped IPv6 host written as IPv4 (a dual-stack socket's view)."""
    if not addr or ":" not in addr:
        return addr
    host, _, port = addr.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{port}"


def proof(token: str, side: str, context: str, server_nonce: bytes, client_nonce: bytes, claims: dict[str, Any]) -> str:
    msg = b"\0".join((_LABEL, side.encode(), context.encode(), server_nonce, client_nonce,
                      json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()))
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Challenge:
    nonce: bytes

    def header(self) -> Header:
        return {"op": "challenge", "v": VERSION, "nonce": self.nonce.hex()}

    @staticmethod
    def parse(h: Header) -> Challenge:
        if h.get("op") != "challenge":
            raise AuthError(f"expected a challenge, got {h.get('op')!r} (not a Kascade peer of this version?)")
        if h.get("v") != VERSION:
            raise AuthError(f"peer speaks peerauth version {h.get('v')!r}, this engine {VERSION}")
        return Challenge(_hex(h.get("nonce"), "nonce", NONCE_BYTES))


@dataclass(frozen=True)
class Hello:
    nonce: bytes
    proof: str
    claims: dict[str, Any] = field(default_factory=dict)

    def header(self) -> Header:
        return {"op": "hello", "nonce": self.nonce.hex(), "proof": self.proof, "claims": self.claims}

    @staticmethod
    def parse(h: Header) -> Hello:
        if h.get("op") != "hello":
            raise AuthError(f"expected a hello, got {h.get('op')!r}")
        claims = h.get("claims")
        if not isinstance(claims, dict):
            raise AuthError("hello field 'claims' must be an object")
        p = h.get("proof")
        _hex(p, "proof", 32)
        return Hello(_hex(h.get("nonce"), "nonce", NONCE_BYTES), str(p), claims)


@dataclass(frozen=True)
class Welcome:
    proof: str

    def header(self) -> Header:
        return {"op": "welcome", "proof": self.proof}


@dataclass(frozen=True)
class Admitted:
    """A client that proved the token: its claims, and the welcome (with the server's proof) to send
    once the caller has also authorised what the claims ask for."""

    claims: dict[str, Any]
    welcome: Welcome


async def accept(conn: Connection, token: str, context: str, timeout: float) -> Admitted:
    """Server side: challenge, check the client's proof (and the address it claims to have dialled).
    On failure the client is told "authentication failed" (nothing more) and AuthError is raised.
    Waits at most HANDSHAKE_TIMEOUT_S for the hello. On success the connection is `admit()`ted (when its
    transport keeps a pending-handshake cap): it no longer counts as a stranger."""
    timeout = min(timeout, HANDSHAKE_TIMEOUT_S)
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        await conn.send(Challenge(nonce).header(), timeout=timeout)
        try:  # a hello announcing a payload is refused unread: nothing is allocated before authentication
            raw, _ = await conn.recv(timeout=timeout, max_payload=0)
        except AuthError:
            raise
        except TransportError as e:
            raise AuthError(f"no valid hello: {e}") from None
        hello = Hello.parse(raw)
        expected = proof(token, "client", context, nonce, hello.nonce, hello.claims)
        if not hmac.compare_digest(expected, hello.proof):
            raise AuthError("wrong proof: the peer does not hold this token")
        local = normal_address(getattr(conn, "local", None))
        to = normal_address(str(hello.claims.get("to", "")))
        if local is not None and to != local:
            raise AuthError(f"proof made for {to}, but this connection arrived at {local} "
                            f"(relayed by another listener, or a proxy/NAT between peers)")
    except AuthError as e:
        log.warning("%s connection from %s refused: %s", context, conn.peer, e)
        with contextlib.suppress(TransportError):
            await conn.send({"op": "error", "message": "authentication failed"}, timeout=timeout)
        raise
    admit = getattr(conn, "admit", None)
    if admit is not None:
        admit()
    return Admitted(hello.claims, Welcome(proof(token, "server", context, nonce, hello.nonce, hello.claims)))


async def join(conn: Connection, token: str, context: str, timeout: float, **claims: Any) -> dict[str, Any]:
    """Client side: answer the server's challenge and check the server's proof. Returns the claims sent.
    Raises AuthError naming the peer when it refuses, or cannot prove it holds the token (not a peer)."""
    try:
        challenge = Challenge.parse((await conn.recv(timeout=timeout, max_payload=0))[0])
    except AuthError as e:
        raise AuthError(f"{conn.peer}: {e}") from None
    claims = {**claims, "to": normal_address(conn.peer)}
    mine = secrets.token_bytes(NONCE_BYTES)
    await conn.send(Hello(mine, proof(token, "client", context, challenge.nonce, mine, claims), claims).header(),
                    timeout=timeout)
    reply, _ = await conn.recv(timeout=timeout, max_payload=0)
    if reply.get("op") == "error":
        raise AuthError(f"{conn.peer} refused the hello: {reply.get('message')}")
    expected = proof(token, "server", context, challenge.nonce, mine, claims)
    if reply.get("op") != "welcome" or not hmac.compare_digest(expected, str(reply.get("proof", ""))):
        raise AuthError(
            f"{conn.peer} could not prove it holds the token (not a Kascade peer of this {context} channel)"
        )
    return claims
