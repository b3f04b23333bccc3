"""s3:// and oci:// source URIs, and the prefixes that admit them, read once for both sides.

* ``s3://BUCKET[/KEY-PREFIX]`` names the objects ``KEY-PREFIX/adapter_config.json`` and
  ``KEY-PREFIX/adapter_model.safetensors`` of a bucket (`S3Source`). It names no endpoint: the
  store is the fleet owner's (an agent's ``--s3-endpoint``), so a port, a userinfo, a query or a
  fragment in the URI is refused, and so is a key with a ``.`` or ``..`` segment (also
  percent-encoded or after a backslash), an empty segment or a control character.
* ``oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]`` names an artifact in a registry
  (`OciSource`), by the OCI distribution grammar: lowercase repository components separated by
  ``/`` (so no ``..``), a tag of at most 128 characters (default ``latest``) or a sha256 digest.
* An allowed prefix (`StoragePrefix`; an agent's ``--allow-source``, a fleet's
  ``spec.sources.allow``) is ``s3://BUCKET[/KEY-PREFIX]`` or ``oci://REGISTRY[/REPOSITORY-PREFIX]``:
  it covers a source of the same bucket (or registry, case-insensitive) whose key prefix (or
  repository) equals its path or continues it after a ``/`` -- the rule of http(s) paths, so
  ``s3://b/team`` covers ``s3://b/team/x`` but not ``s3://b/teams``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import unquote

from lorafleet_common.sources import OCI_SCHEME, S3_SCHEME, SourcePrefix, SourceRefusal, has_dot_segment, redact_uri

STORAGE_SCHEMES = (S3_SCHEME, OCI_SCHEME)
DEFAULT_TAG = "latest"
# S3's bucket naming rules: 3-63 lowercase letters, digits, '.' and '-', a letter or digit at
# each end, no "..", not an IPv4 address.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# The OCI distribution spec's reference grammar.
_REPOSITORY_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*$")
_MAX_REPOSITORY = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class InvalidStorageUri(ValueError):
    """An s3:// or oci:// URI (or prefix) that names nothing valid; `refusal` says which kind."""

    def __init__(self, message: str, refusal: SourceRefusal) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(frozen=True)
class S3Source:
    """An s3:// source: the bucket and the key prefix its two objects lie under ("" for the top)."""

    bucket: str
    key_prefix: str

    def key(self, filename: str) -> str:
        """The object key of one adapter file."""
        return f"{self.key_prefix}/{filename}" if self.key_prefix else filename


@dataclass(frozen=True)
class OciSource:
    """An oci:// source: the registry (host[:port], lowercase), the repository, and the tag or the
    digest it names (a digest pins it; else the tag is resolved once to one)."""

    registry: str
    repository: str
    tag: str
    digest: str  # "" unless the URI gives one

    @property
    def reference(self) -> str:
        """What the manifest is first fetched by: the digest when given, else the tag."""
        return self.digest or self.tag


@dataclass(frozen=True)
class StoragePrefix:
    """One allowed s3:// bucket prefix or oci:// registry prefix: the scheme, the bucket or
    registry, and the key or repository path under it ("" for all of it)."""

    scheme: str
    location: str
    path: str

    @classmethod
    def parse(cls, text: str) -> StoragePrefix:
        """The prefix `text` names; InvalidStorageUri saying what is wrong."""
        scheme, _, rest = text.partition("://")
        scheme = scheme.lower()
        _refuse_query_and_userinfo(text, rest)
        location, _, path = rest.partition("/")
        if scheme == S3_SCHEME:
            return cls(scheme, _bucket(location, text), _key_path(path, text))
        if scheme == OCI_SCHEME:
            path = path.rstrip("/")
            if path:
                _repository(path, text)
            return cls(scheme, _registry(location, text), path)
        raise InvalidStorageUri(f"{redact_uri(text)!r} is not an s3:// or oci:// prefix", SourceRefusal.INVALID)

    def covers(self, scheme: str, location: str, path: str) -> bool:
        """Whether a source of this bucket or registry whose key prefix or repository is `path`
        lies under this prefix."""
        if (scheme, location) != (self.scheme, self.location):
            return False
        return not self.path or path == self.path or path.startswith(self.path + "/")


def parse_allow_entry(text: str) -> SourcePrefix | StoragePrefix:
    """One ``--allow-source`` entry: an http(s) URL prefix, or an s3:// or oci:// prefix;
    ValueError saying what is wrong."""
    if text.partition("://")[0].lower() in STORAGE_SCHEMES:
        try:
            return StoragePrefix.parse(text)
        except InvalidStorageUri as error:
            raise ValueError(f"--allow-source {redact_uri(text)!r}: {error}") from None
    return SourcePrefix.parse(text)


def _refuse_query_and_userinfo(text: str, rest: str) -> None:
    if "?" in text or "#" in text:
        raise InvalidStorageUri(f"{redact_uri(text)!r} must not have a query or fragment", SourceRefusal.NOT_A_DIRECTORY)
    if "@" in rest.partition("/")[0]:
        raise InvalidStorageUri(f"{redact_uri(text)!r} must not have credentials", SourceRefusal.CREDENTIALS)


def _bucket(name: str, text: str) -> str:
    if ":" in name:
        raise InvalidStorageUri(
            f"{redact_uri(text)!r} names an endpoint, not a bucket: an s3:// URI is s3://BUCKET/KEY-PREFIX and the "
            "store's endpoint is the fleet owner's (--s3-endpoint)",
            SourceRefusal.ENDPOINT,
        )
    if not _BUCKET.match(name) or ".." in name or _is_ip(name):
        raise InvalidStorageUri(f"{name!r} in {redact_uri(text)!r} is not a valid S3 bucket name", SourceRefusal.INVALID)
    return name


def _key_path(raw: str, text: str) -> str:
    """A key prefix, percent-decoded, without its trailing '/'."""
    if has_dot_segment(raw):
        raise InvalidStorageUri(f"'.' and '..' segments are refused in S3 keys: {redact_uri(text)!r}", SourceRefusal.DOT_SEGMENT)
    key = unquote(raw).rstrip("/")
    if _CONTROL.search(key) or "//" in key or key.startswith("/"):
        raise InvalidStorageUri(
            f"the key prefix in {redact_uri(text)!r} has an empty segment or a control character", SourceRefusal.INVALID
        )
    return key


def _registry(location: str, text: str) -> str:
    host, colon, port = location.lower().rpartition(":") if ":" in location else (location.lower(), "", "")
    if colon and not (port.isdigit() and 0 < int(port) < 65536):
        raise InvalidStorageUri(f"the registry in {redact_uri(text)!r} has an invalid port", SourceRefusal.INVALID)
    if not _HOST.match(host):
        raise InvalidStorageUri(f"the registry in {redact_uri(text)!r} is not a host name or IPv4 address", SourceRefusal.INVALID)
    return location.lower()


def _repository(path: str, text: str) -> str:
    if has_dot_segment(path):
        raise InvalidStorageUri(f"'.' and '..' segments are refused in repository names: {redact_uri(text)!r}", SourceRefusal.DOT_SEGMENT)
    if len(path) > _MAX_REPOSITORY or not all(_REPOSITORY_COMPONENT.match(c) for c in path.split("/")):
        raise InvalidStorageUri(
            f"the repository in {redact_uri(text)!r} is not a valid OCI repository name (lowercase components "
            "of letters and digits joined by '.', '_', '__' or '-', separated by '/')",
            SourceRefusal.INVALID,
        )
    return path


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _split_scheme(uri: str, scheme: str) -> str:
    head, sep, rest = uri.partition("://")
    if not sep or head.lower() != scheme:
        raise InvalidStorageUri(f"{redact_uri(uri)!r} is not an {scheme}:// URI", SourceRefusal.INVALID)
    _refuse_query_and_userinfo(uri, rest)
    return rest


def parse_s3_uri(uri: str) -> S3Source:
    """The bucket and key prefix of ``s3://BUCKET[/KEY-PREFIX]``; InvalidStorageUri otherwise."""
    bucket, _, path = _split_scheme(uri, S3_SCHEME).partition("/")
    return S3Source(_bucket(bucket, uri), _key_path(path, uri))


def parse_oci_uri(uri: str) -> OciSource:
    """The registry, repository and tag or digest of ``oci://REGISTRY/REPOSITORY[:TAG|@DIGEST]``;
    InvalidStorageUri otherwise."""
    registry, _, name = _split_scheme(uri, OCI_SCHEME).partition("/")
    name, at, digest = name.partition("@")
    if at and not _DIGEST.match(digest):
        raise InvalidStorageUri(f"the digest in {redact_uri(uri)!r} is not sha256: and 64 lowercase hex digits", SourceRefusal.INVALID)
    colon = name.find(":", name.rfind("/") + 1)  # a tag follows the last component's ':'
    repository, tag = (name[:colon], name[colon + 1 :]) if colon >= 0 else (name, "")
    if tag and at:
        raise InvalidStorageUri(f"{redact_uri(uri)!r} gives both a tag and a digest: give one", SourceRefusal.INVALID)
    if colon >= 0 and not _TAG.match(tag):
        raise InvalidStorageUri(f"the tag in {redact_uri(uri)!r} is not a valid OCI tag", SourceRefusal.INVALID)
    if not repository:
        raise InvalidStorageUri(f"{redact_uri(uri)!r} names no repository: oci://REGISTRY/REPOSITORY[:TAG]", SourceRefusal.INVALID)
    return OciSource(_registry(registry, uri), _repository(repository, uri), tag or (DEFAULT_TAG if not at else ""), digest)


def storage_refusal(uri: str, prefixes: tuple[StoragePrefix, ...]) -> SourceRefusal | None:
    """Why an s3:// or oci:// source is not admitted under `prefixes` (None: it is)."""
    try:
        if uri.partition("://")[0].lower() == S3_SCHEME:
            s3 = parse_s3_uri(uri)
            where = (S3_SCHEME, s3.bucket, s3.key_prefix)
        else:
            oci = parse_oci_uri(uri)
            where = (OCI_SCHEME, oci.registry, oci.repository)
    except InvalidStorageUri as error:
        return error.refusal
    return None if any(prefix.covers(*where) for prefix in prefixes) else SourceRefusal.NOT_COVERED
