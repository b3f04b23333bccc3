"""How an oci:// download authenticates to its registry: the answer to the registry's challenge.

Requests start anonymous. A registry that wants more answers 401 with ``WWW-Authenticate``:

* ``Bearer realm=...,service=...,scope=...`` (the distribution token protocol: Docker Hub, GHCR,
  Harbor, distribution's ``auth: token``): the agent asks the realm for a pull token for this
  repository, sending the load's credential (if any) to the realm alone, and then sends
  ``Authorization: Bearer TOKEN`` to the registry's own URLs. The realm must be on the registry's
  own host and port, or under an http(s) ``--allow-source`` prefix; it is fetched through the same
  checked downloader, and the token is never logged or repeated.
* ``Basic`` (htpasswd-protected registries): the load's credential goes to the registry's URLs.

Every header goes to the URL it was made for only, never on a redirect (a blob store's).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import urlencode, urlsplit

from lorafleet_common.sources import HTTP_SCHEMES, check_url
from node_agent.errors import SourceRefused
from node_agent.sources.credentials import SourceCredential
from node_agent.sources.downloads import Fetcher

MAX_TOKEN_ANSWER_BYTES = 64 << 10
_TOKEN_FILE = ".token.json"  # read, then removed
_PARAM = re.compile(r'(\w+)="([^"]*)"')
_TOKEN = re.compile(r"^[\x21-\x7e]{1,8192}$")


@dataclass
class RegistryAuth:
    """The Authorization a download sends to one registry's URLs, learned from its challenge."""

    fetcher: Fetcher
    credential: SourceCredential | None
    registry: str  # host[:port], as the URI names it
    repository: str
    shown: str
    headers: dict[str, str] = field(default_factory=dict)

    def answer_challenge(self) -> bool:
        """After a refusal: whether the registry's last answer was a challenge this download can
        now meet (then `headers` carry the answer; ask again); False when there is none, or it
        was already answered."""
        challenge = self.fetcher.answers[-1].get("WWW-Authenticate", "") if self.fetcher.answers else ""
        scheme, _, params = challenge.partition(" ")
        if self.headers or scheme.lower() not in ("bearer", "basic"):
            return False
        if scheme.lower() == "basic":
            if self.credential is None:
                return False
            self.headers = {"Authorization": self.credential.authorization}
            return True
        self.headers = {"Authorization": f"Bearer {self._token(dict(_PARAM.findall(params)))}"}
        return True

    def _token(self, params: dict[str, str]) -> str:
        """A pull token for the repository from the challenge's realm."""
        realm = params.get("realm", "")
        self._check_realm(realm)
        query = {"scope": params.get("scope") or f"repository:{self.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": self.credential.authorization} if self.credential is not None else {}
        path = self.fetcher.directory / _TOKEN_FILE
        try:
            self.fetcher.fetch(f"{realm}?{urlencode(query)}", path, MAX_TOKEN_ANSWER_BYTES, headers)
            answer = json.loads(path.read_bytes())
        except (UnicodeDecodeError, ValueError):
            answer = None
        finally:
            path.unlink(missing_ok=True)
        token = (answer.get("token") or answer.get("access_token")) if isinstance(answer, dict) else None
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise SourceRefused(f"the token service of {self.shown} sent no usable token", "registry_auth")
        return token

    def _check_realm(self, realm: str) -> None:
        """The realm is an http(s) URL on the registry's own host and port, or one the fleet's
        owner allows (--allow-source); it is not repeated (the registry chose it)."""
        try:
            parts = urlsplit(realm)
            own = parts.netloc.lower() == self.registry
        except ValueError:
            parts, own = None, False
        plain = parts is not None and parts.scheme in HTTP_SCHEMES and not parts.query and not parts.fragment and "@" not in parts.netloc
        allowed = own or check_url(realm, self.fetcher.download.policy.prefixes) is None
        if not (plain and allowed):
            raise SourceRefused(
                f"the token service {self.shown} names is refused: it must be an http(s) URL on the registry's own host, "
                "or under an --allow-source prefix",
                "registry_auth",
            )
