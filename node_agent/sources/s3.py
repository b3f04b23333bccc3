"""s3:// sources: an adapter's two objects from the fleet owner's S3-compatible store.

``s3://BUCKET[/KEY-PREFIX]`` is read by `lorafleet_common.storage.parse_s3_uri`, the rule the
operator applies too, and must lie under an ``--allow-source s3://BUCKET[/PREFIX]`` entry. The
store is the agent's ``--s3-endpoint`` (path-style requests, ``ENDPOINT/BUCKET/KEY``), never a
request's. Each GET is signed with AWS Signature Version 4 by the AWS Common Runtime
(`awscrt.auth.aws_sign_request`: botocore would pin python-dateutil below the version the
Kubernetes client requires) when a
credential is given (the load's own, else the agent's; none: anonymous requests), and the bytes
travel through the agent's own checked downloader (`downloads`): addresses checked against the
SSRF rules, redirects only under an http(s) ``--allow-source`` prefix (and never with the
signature), size caps, deadline, minimum rate, progress, the downloaded config and weights
checked. Each object's version id (or, unversioned, its ETag) is recorded in the source's
`revision`; `resolve_s3` reads the same from a signed HEAD of each object (the operator's
resolution before its loads), downloading nothing.
"""

from __future__ import annotations

import logging
import re
from http.client import HTTPMessage
from urllib.parse import quote, urlsplit

from awscrt.auth import (
    AwsCredentialsProvider,
    AwsSignatureType,
    AwsSignedBodyHeaderType,
    AwsSignedBodyValue,
    AwsSigningAlgorithm,
    AwsSigningConfig,
    aws_sign_request,
)
from awscrt.http import HttpHeaders, HttpRequest

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lorafleet_common.storage import S3Source, parse_s3_uri
from node_agent.errors import SourceRefused
from node_agent.sources.copies import MAX_CONFIG_BYTES, ResolvedSource, Written
from node_agent.sources.credentials import S3Credential
from node_agent.sources.downloads import Download, Fetcher, check_downloaded_config, check_downloaded_weights, fetching, probing
from node_agent.sources.policy import SourcePolicy, admit_storage_source

log = logging.getLogger(__name__)

S3_ENDPOINT_FLAG = "--s3-endpoint"
_VERSION = re.compile(r"^[A-Za-z0-9._+/=-]{1,128}$")


def download_s3(uri: str, download: Download, credential: S3Credential | None) -> ResolvedSource:
    """A private copy of the adapter an s3:// URI names, from the policy's endpoint, with each
    object's version id or ETag as its revision."""
    policy = download.policy
    source = _admitted(uri, policy, download.shown)
    signer = _Signer(credential or _agent_credential(policy), policy.s3_region)
    with fetching(download) as fetcher:
        config, config_version = _get(fetcher, object_url(policy, source, ADAPTER_CONFIG), ADAPTER_CONFIG, MAX_CONFIG_BYTES, signer)
        check_downloaded_config(fetcher.directory, download.shown)
        weights_url = object_url(policy, source, ADAPTER_WEIGHTS)
        weights, weights_version = _get(fetcher, weights_url, ADAPTER_WEIGHTS, policy.max_download_bytes, signer)
        check_downloaded_weights(fetcher.directory / ADAPTER_WEIGHTS, download.shown)
    revision = _revision(config_version, weights_version)
    log.debug("downloaded %s (%s)", download.shown, revision)
    return ResolvedSource.of_copy(uri, fetcher.directory, weights, config, downloaded=True, revision=revision)


def resolve_s3(uri: str, download: Download, credential: S3Credential | None) -> str:
    """The revision an s3:// URI's two objects have now (each one's version id or ETag), as
    their download would record it, from one signed HEAD request each (no object is fetched;
    one declared over its cap is refused as its download would be)."""
    policy = download.policy
    source = _admitted(uri, policy, download.shown)
    signer = _Signer(credential or _agent_credential(policy), policy.s3_region)
    versions = []
    with probing(download) as fetcher:
        for filename, cap in ((ADAPTER_CONFIG, MAX_CONFIG_BYTES), (ADAPTER_WEIGHTS, policy.max_download_bytes)):
            url = object_url(policy, source, filename)
            versions.append(_version(fetcher.head(url, cap, signer.headers(url, "HEAD"))))
    revision = _revision(*versions)
    log.debug("resolved %s to %s", download.shown, revision)
    return revision


def _revision(config_version: str, weights_version: str) -> str:
    """An s3:// source's revision: both objects' version ids or ETags."""
    return f"{ADAPTER_CONFIG} {config_version}; {ADAPTER_WEIGHTS} {weights_version}"


def _admitted(uri: str, policy: SourcePolicy, shown: str) -> S3Source:
    """The source, once the URI is valid and allowed, and the agent has a store."""
    source = admit_storage_source(uri, policy, shown, parse_s3_uri, "s3://BUCKET/PREFIX")
    if not policy.s3_endpoint:
        raise SourceRefused(f"s3:// sources are refused: this agent has no S3 endpoint ({S3_ENDPOINT_FLAG} URL)", "no_s3_endpoint")
    return source


def _agent_credential(policy: SourcePolicy) -> S3Credential | None:
    """The agent's own credential: its keys, else its web identity's (None: anonymous)."""
    if policy.s3_credential is None and policy.s3_web_identity is not None:
        return policy.s3_web_identity.current()
    return policy.s3_credential


def object_url(policy: SourcePolicy, source: S3Source, filename: str) -> str:
    """The path-style URL of one adapter file's object at the policy's endpoint."""
    return f"{policy.s3_endpoint.rstrip('/')}/{source.bucket}/{quote(source.key(filename), safe='/-_.~')}"


def sign_s3_request(method: str, url: str, credential: S3Credential, region: str, payload_sha256: str | None = None) -> dict[str, str]:
    """The headers that authenticate one S3 request (SigV4: ``Authorization``, ``X-Amz-Date``,
    ``x-amz-content-sha256``, a session token's header). `url` is already percent-encoded, as
    sent; `payload_sha256` is the body's hex sha256 (None: no body)."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    request = HttpRequest(method, path, HttpHeaders([("host", parts.netloc)]))
    config = AwsSigningConfig(
        algorithm=AwsSigningAlgorithm.V4,
        signature_type=AwsSignatureType.HTTP_REQUEST_HEADERS,
        credentials_provider=AwsCredentialsProvider.new_static(
            credential.access_key_id, credential.secret_access_key, credential.session_token or None
        ),
        region=region,
        service="s3",
        # S3's own rules: the path is signed as sent (encoded once, never normalised).
        use_double_uri_encode=False,
        should_normalize_uri_path=False,
        signed_body_value=payload_sha256 or AwsSignedBodyValue.EMPTY_SHA256,
        signed_body_header_type=AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
    )
    aws_sign_request(request, config).result()
    return {name: value for name, value in request.headers if name.lower() != "host"}


class _Signer:
    """Signs requests with SigV4 for S3, or leaves them anonymous."""

    def __init__(self, credential: S3Credential | None, region: str) -> None:
        self._credential, self._region = credential, region

    def headers(self, url: str, method: str = "GET") -> dict[str, str]:
        """The headers that authenticate a request of `url` (none when anonymous)."""
        if self._credential is None:
            return {}
        return sign_s3_request(method, url, self._credential, self._region)


def _get(fetcher: Fetcher, url: str, filename: str, cap: int, signer: _Signer) -> tuple[Written, str]:
    """One object into the download's directory as `filename`, and its version id or ETag."""
    written = fetcher.fetch(url, fetcher.directory / filename, cap, signer.headers(url))
    return written, _version(fetcher.answers[-1])


def _version(answer: HTTPMessage) -> str:
    """An object's version id, or unversioned its ETag, as its answer (a GET's or a HEAD's) names it."""
    version, etag = answer.get("x-amz-version-id", ""), answer.get("ETag", "").strip('"')
    # What the store answered is recorded only when it looks like a version id or an ETag.
    if _VERSION.match(version) and version != "null":
        return f"version {version}"
    return f"etag {etag}" if _VERSION.match(etag) else "etag unknown"
