"""Registry auth for an oci:// source, from a ``kubernetes.io/dockerconfigjson`` Secret.

The Secret's ``.dockerconfigjson`` is the file ``docker login`` writes (``{"auths": {REGISTRY:
{"auth": base64("user:password")} | {"username": ..., "password": ...}}}``), as ``kubectl create
secret docker-registry`` makes it. The entry of the source's own registry is the one used: its key
read as ``docker`` reads it (a host[:port], or a URL whose scheme and path are ignored; Docker
Hub's historical names are one registry), compared case-insensitively with the registry of the
URI. Its user and password go to the agent, which answers the registry's challenge with them
(a pull token from its token service, or HTTP basic). An ``identitytoken`` alone (an OAuth
refresh token) is refused: the agents do not speak that flow.

No message repeats what the Secret holds beyond the registry's name the adapter itself gave.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

DOCKER_CONFIG_KEY = ".dockerconfigjson"
# Docker Hub answers under several names; a docker config names it by its index's URL.
_DOCKER_HUB = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"})


class NoRegistryLogin(ValueError):
    """A docker config that holds no usable login for the registry; the message says why."""


def _refused(message: str) -> NoRegistryLogin:
    return NoRegistryLogin(message)


def registry_key(name: str) -> str:
    """A docker config's registry key as ``docker`` reads it: lowercase host[:port], without a
    scheme or path; Docker Hub's names as one."""
    host = name.strip().lower().partition("://")[2] or name.strip().lower()
    host = host.partition("/")[0]
    return "docker.io" if host in _DOCKER_HUB else host


def _entries(raw: bytes) -> Mapping[str, Any]:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        config = None
    auths = config.get("auths") if isinstance(config, dict) else None
    if not isinstance(auths, dict):
        raise _refused(f"the Secret's {DOCKER_CONFIG_KEY} is not a docker config (a JSON object with an 'auths' object)")
    return auths


def _user_and_password(entry: Mapping[str, Any], registry: str) -> tuple[str, str]:
    username, password = entry.get("username"), entry.get("password")
    if isinstance(username, str) and isinstance(password, str) and username and password:
        return username, password
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            username, colon, password = base64.b64decode(auth, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            colon = ""
        if colon and username and password:
            return username, password
        raise _refused(f"the docker config's entry for {registry} has an 'auth' that is not base64 of user:password")
    if entry.get("identitytoken"):
        raise _refused(
            f"the docker config's entry for {registry} holds only an identity token (an OAuth refresh token), which the "
            "agents do not use: give a user and password (a robot or service account's)"
        )
    raise _refused(f"the docker config's entry for {registry} has no user and password")


def registry_login(raw: bytes, registry: str) -> tuple[str, str]:
    """The user and password a docker config (a ``.dockerconfigjson`` value) holds for
    ``registry`` (host[:port]); NoRegistryLogin when it holds none it can use."""
    wanted = registry_key(registry)
    for name, entry in _entries(raw).items():
        if isinstance(name, str) and registry_key(name) == wanted and isinstance(entry, dict):
            return _user_and_password(entry, registry)
    raise _refused(f"the Secret's docker config has no entry for registry {registry}")
