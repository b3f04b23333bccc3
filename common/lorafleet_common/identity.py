"""The agent's proof of identity (``NodeAgent.ProveIdentity``): the one rule both sides compute.

Before the operator sends a fleet's token (or a source credential) to a pod, the pod must show
that it holds the token already: the operator sends a fresh random nonce, and a lorafleet agent
answers HMAC-SHA256(token, CONTEXT || nonce). A pod that merely carries the fleet's labels
cannot answer; the nonce makes an old answer useless. The context string keeps the proof from
meaning anything in another protocol that might MAC the same token.
"""

from __future__ import annotations

import hashlib
import hmac

#: Domain separation: what the MAC is about, and the protocol version.
CONTEXT = b"lorafleet.v1 agent identity proof\x00"
#: The nonce's length in bytes; the agent refuses any other.
NONCE_BYTES = 32


def identity_proof(token: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``CONTEXT || nonce`` keyed with the bearer token (its ASCII bytes)."""
    return hmac.new(token.encode(), CONTEXT + nonce, hashlib.sha256).digest()


def proof_matches(token: str, nonce: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is the token's proof for ``nonce`` (compared in constant time)."""
    return hmac.compare_digest(identity_proof(token, nonce), proof)
