"""What a LoraAdapter's source resolved to (``status.source``), and what loads must find.

For s3:// and oci:// the revision is resolved once, before the first loads are sent, by one
agent (`source_resolution`: ResolveSource), and recorded as ``status.source: {uri,
revision}``; every load of the same URI (the first fan-out's, another agent's, a repair's, a
restarted agent's) sends it, so that the agent refuses content other than what was recorded:
an oci:// tag moved since (``tag_moved``), an s3:// object overwritten since
(``source_changed``). An agent's successful load answers the revision its source resolved to
as well (an oci:// manifest digest, an s3:// object's version id or ETag, an hf:// commit): the
first one answered is recorded where none was (hf://, agents older than ResolveSource). A spec
naming another URI is resolved anew (the record names the URI it was made for); hf://
revisions are recorded, not held (a revision given in the URI already pins them). The revision
is what the agent checked and validated, never a credential.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lorafleet_common.sources import OCI_SCHEME, S3_SCHEME, scheme_of
from lorafleet_operator.agent_values import SourceRevision

#: The schemes whose recorded revision later loads must find.
HELD_SCHEMES = (S3_SCHEME, OCI_SCHEME)
#: status.source.revision's bound (the CRD's maxLength): an s3:// revision names two objects.
MAX_REVISION = 512


def held_revision(uri: str, status: Mapping[str, Any]) -> str:
    """The revision a load of ``uri`` must find: the one ``status.source`` records for this same
    URI, for an s3:// or oci:// source ("" otherwise: resolved as the agent finds it)."""
    recorded = status.get("source")
    if scheme_of(uri) not in HELD_SCHEMES or not isinstance(recorded, Mapping) or recorded.get("uri") != uri:
        return ""
    revision = recorded.get("revision")
    return revision if isinstance(revision, str) else ""


def recorded_source(reported: Iterable[SourceRevision | None], previous: Mapping[str, Any] | None) -> Any:
    """``status.source`` after these loads: the first revision one of them reported (one too long
    for status is not recorded), else the record already stored (None where there is none: a
    merge patch leaves it absent)."""
    for source in reported:
        if source is not None and source.revision and len(source.revision) <= MAX_REVISION:
            return source.to_status()
    return (previous or {}).get("source")
