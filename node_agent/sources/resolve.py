"""From a LoadAdapter URI to a checked private copy of its adapter: the scheme decides which
source reads it, and every source's copy is held to the request's sha256 and revision; and
from a ResolveSource URI to that revision alone (`source_revision`), under the same checks."""

from __future__ import annotations

from typing import TypeVar
from urllib.parse import SplitResult, urlsplit

from lorafleet_common.sources import ADAPTER_WEIGHTS, HTTP_SCHEMES, HUB_SCHEME, OCI_SCHEME, S3_SCHEME, redact_uri, userinfo_span
from node_agent.errors import SourceRefused
from node_agent.sources.copies import ResolvedSource
from node_agent.sources.credentials import Credential, S3Credential, SourceCredential
from node_agent.sources.downloads import Download, DownloadProgress, download_http
from node_agent.sources.files import resolve_file
from node_agent.sources.hub import download_hub
from node_agent.sources.oci import download_oci, resolve_oci
from node_agent.sources.policy import SourcePolicy
from node_agent.sources.s3 import download_s3, resolve_s3

CredentialT = TypeVar("CredentialT", SourceCredential, S3Credential)


def resolve_source(
    uri: str,
    expected_sha256: str | None,
    policy: SourcePolicy,
    credential: Credential | None = None,
    progress: DownloadProgress | None = None,
    revision: str = "",
) -> ResolvedSource:
    """Check `uri` against the policy and make a private copy of its adapter. A `credential` is
    sent to the source's own URLs only (a header credential: http(s), hf://, oci://) or signs its
    requests (an S3 credential: s3://): never on a redirect, never logged or repeated in a
    message; a file:// source with one is refused. A download counts its bytes into `progress`.
    A `revision` (the operator's record of the source's first load) is what the source must
    still resolve to: an oci:// tag must still name that manifest digest (checked before any
    layer is fetched), any other source's `ResolvedSource.revision` must equal it."""
    shown = redact_uri(uri)
    parts = _parts(uri, shown)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if credential is not None:
            raise SourceRefused(f"file:// sources take no credential ({shown!r})", "credentials")
        source = resolve_file(uri, shown, parts.netloc, parts.path, parts.query or parts.fragment, policy)
    elif scheme == S3_SCHEME:
        source = download_s3(uri, Download(shown, policy, None, progress), _credential_of(S3Credential, credential, scheme))
    elif scheme == OCI_SCHEME:
        source = download_oci(uri, Download(shown, policy, None, progress), _credential_of(SourceCredential, credential, scheme), revision)
    elif scheme in HTTP_SCHEMES:
        source = download_http(uri, Download(shown, policy, _credential_of(SourceCredential, credential, scheme), progress))
    elif scheme == HUB_SCHEME:
        source = download_hub(uri, Download(shown, policy, _credential_of(SourceCredential, credential, scheme), progress))
    else:
        raise _scheme_refused(scheme, shown)
    if revision and source.revision != revision:
        source.discard()
        raise SourceRefused(
            f"{shown} changed since it was first resolved: it is now {source.revision or 'of no revision'}, "
            f"not {revision} (the revision its adapter's status records); refused so that every agent holds the same content",
            "source_changed",
        )
    if expected_sha256 is not None and source.content.weights_sha256 != expected_sha256:
        source.discard()
        raise SourceRefused(
            f"sha256 mismatch for {shown}: {ADAPTER_WEIGHTS} has {source.content.weights_sha256}, expected {expected_sha256}",
            "sha256_mismatch",
        )
    return source


def source_revision(uri: str, policy: SourcePolicy, credential: Credential | None = None) -> str:
    """What an s3:// or oci:// source resolves to now, as its load would record it
    (`ResolvedSource.revision`: an oci:// manifest digest, s3:// objects' version ids or
    ETags), without copying it: under the same policy and checks as `resolve_source` (the URI,
    the allowlists, the address rules, the credential, the caps the answers declare), failing
    with the same errors. "" for the other schemes (file://, http(s)://, hf://: a load
    resolves them as it finds them); an unknown scheme is refused as a load's would be."""
    shown = redact_uri(uri)
    scheme = _parts(uri, shown).scheme.lower()
    if scheme == S3_SCHEME:
        return resolve_s3(uri, Download(shown, policy), _credential_of(S3Credential, credential, scheme))
    if scheme == OCI_SCHEME:
        return resolve_oci(uri, Download(shown, policy), _credential_of(SourceCredential, credential, scheme))
    if scheme not in ("file", HUB_SCHEME, *HTTP_SCHEMES):
        raise _scheme_refused(scheme, shown)
    return ""


def _parts(uri: str, shown: str) -> SplitResult:
    """The URI's parts, once it parses and names no credentials (userinfo)."""
    try:
        parts = urlsplit(uri)
    except ValueError as error:
        raise SourceRefused(f"source URI {shown!r} is not a valid URI: {error}", "bad_uri") from None
    if "@" in parts.netloc or userinfo_span(uri) is not None:
        raise SourceRefused(
            f"credentials in source URIs are refused ({shown!r}): the agent never sends or logs "
            "URL userinfo; serve the adapter without them",
            "credentials",
        )
    return parts


def _scheme_refused(scheme: str, shown: str) -> SourceRefused:
    return SourceRefused(
        f"source scheme {scheme or '(none)'!r} is refused in {shown!r}: use file://, http(s)://, hf://, s3:// or oci://", "scheme"
    )


def _credential_of(kind: type[CredentialT], credential: Credential | None, scheme: str) -> CredentialT | None:
    """The load's credential when it is of the kind this scheme takes (an S3 credential for
    s3://, a header credential for the others); SourceRefused otherwise (without showing it)."""
    if credential is None or isinstance(credential, kind):
        return credential
    wanted = "an S3 access key" if kind is S3Credential else "a token or a user and password"
    raise SourceRefused(f"{scheme}:// sources take {wanted} as their credential", "credentials")
