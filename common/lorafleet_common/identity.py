"""The agent's proof of identity (``NodeAgent.ProveIdentity``): the one rule both sides compute.

Before the operator sends a fleet's token (or a source credential) to a pod, the pod must show
that it holds the token already: the operator sends a fresh random nonce and the pod it believes
it talks to ("NAMESPACE/NAME"), and a lorafleet agent answers
HMAC-SHA256(token, CONTEXT || pod || 0x00 || nonce). A pod that merely carries the fleet's labels
cannot answer; the nonce makes an old answer useless; the pod's name in the MAC makes an answer
relayed from another pod's agent fail (an agent that knows its own name, ``--pod-name``, answers
only for itself). The context string keeps the proof from meaning anything in another protocol
that might MAC the same token.
"""

from __future__ import annotations

import hashlib
import hmac

#: Domain separation: what the MAC is about, and the protocol version.
CONTEXT = b"lorafleet.v1 agent identity proof\x00"
#: The nonce's length in bytes; the agent refuses any other.
NONCE_BYTES = 32


def identity_proof(token: str, pod: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``CONTEXT || pod || 0x00 || nonce`` keyed with the bearer token (its
    ASCII bytes); the zero byte ends the pod's name, so no two (pod, nonce) pairs collide."""
    return hmac.new(token.encode(), CONTEXT + pod.encode() + b"\x00" + nonce, hashlib.sha256).digest()


def proof_matches(token: str, pod: str, nonce: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is the token's proof for ``pod`` and ``nonce`` (constant time)."""
    return hmac.compare_digest(identity_proof(token, pod, nonce), proof)
