"""Which adapter sources a LoraFleet admits: the fleet owner's ``spec.sources.allow`` prefixes.

Remote sources (http(s) and hf://) are off for a fleet until its owner names prefixes; file://
sources are bounded by the agents' adapter roots instead. Two kinds of prefix:

* ``http(s)://host[:port]/path``: a source is under it when it starts with it (the CRD makes
  the path start with "/", so a prefix cannot match a longer host name);
* ``hf://ORG/`` (every repository of the organisation) or ``hf://ORG/REPO`` (that repository,
  at any revision and in any folder): compared by name, so ``hf://org/lora`` does not cover
  ``hf://org/lora2`` and ``hf://org/`` does not cover ``hf://organisation/x``.

The agents check again (their own ``--allow-source``; for hf:// the endpoint they fetch from).
"""

from __future__ import annotations

from collections.abc import Sequence

HTTP_SCHEMES = ("http://", "https://")
HUB_SCHEME = "hf://"


def is_remote(uri: str) -> bool:
    """Whether the agents download this source (http(s) or hf://)."""
    return uri.startswith((*HTTP_SCHEMES, HUB_SCHEME))


def _hub_names(uri: str) -> list[str]:
    """An hf:// URI's organisation and repository (``@REVISION`` and folders dropped)."""
    org, _, rest = uri[len(HUB_SCHEME) :].partition("/")
    repo = rest.split("/", 1)[0].partition("@")[0]
    return [org, repo]


def under_prefix(uri: str, prefix: str) -> bool:
    """Whether the source ``uri`` lies under one ``spec.sources.allow`` prefix."""
    if prefix.startswith(HUB_SCHEME):
        if not uri.startswith(HUB_SCHEME):
            return False
        wanted = [name for name in prefix[len(HUB_SCHEME) :].split("/") if name]
        return bool(wanted) and _hub_names(uri)[: len(wanted)] == wanted
    return uri.startswith(prefix)


def admitted(uri: str, allow: Sequence[str]) -> bool:
    """Whether the fleet admits this source: not remote, or under one of its prefixes."""
    return not is_remote(uri) or any(under_prefix(uri, prefix) for prefix in allow)
