"""hf:// sources: the two files of a Hub repository (or a mirror's), both at one pinned commit.

The URI is read by `lorafleet_common.hub.parse_hub_uri`, the rule the operator applies too. A
branch or tag is pinned to the commit the Hub names for the first file (its ``X-Repo-Commit``
header), and the second file is fetched at that commit, so both files always come from one
commit even while the branch moves. The URL layout is huggingface_hub's (`hf_hub_url`); the
bytes travel through the agent's own checked downloader (`downloads`), so an hf:// source gets
every check an http(s) source gets: the URL (the endpoint's, set by the fleet's owner with
``--hub-endpoint``, never by a request) and every redirect hop must be under an
``--allow-source`` prefix, addresses are checked, the size is capped, a deadline and a minimum
rate apply, the sha256 is computed, pickle is never read.
"""

from __future__ import annotations

import logging

from huggingface_hub import hf_hub_url

from lorafleet_common.hub import HubSource, InvalidHubUri, is_commit, parse_hub_uri
from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SourceRefusal
from node_agent.errors import SourceRefused
from node_agent.sources.copies import ResolvedSource
from node_agent.sources.downloads import COMMIT_HEADER, Download, fetch_adapter
from node_agent.sources.policy import check_allowed

log = logging.getLogger(__name__)


def download_hub(uri: str, download: Download) -> ResolvedSource:
    """A private copy of the adapter an hf:// URI names, from the policy's hub endpoint, with the
    commit both files were fetched at."""
    hub = _parse(uri)
    endpoint = download.policy.hub_endpoint
    config_url = file_url(hub, endpoint, ADAPTER_CONFIG)
    for url in (config_url, file_url(hub, endpoint, ADAPTER_WEIGHTS)):
        check_allowed(url, download.policy.prefixes, what=f"the source {download.shown!r}")

    def weights_url(answered: str | None) -> str:
        return file_url(hub, endpoint, ADAPTER_WEIGHTS, pinned_commit(hub, answered, download.shown))

    fetched = fetch_adapter(download, config_url, weights_url)
    commit = pinned_commit(hub, fetched.commit, download.shown)
    log.debug("downloaded %s (%s at commit %s) into %s", download.shown, hub.repo_id, commit, fetched.directory)
    return ResolvedSource.of_copy(uri, fetched.directory, fetched.weights, fetched.config, downloaded=True, revision=commit)


def _parse(uri: str) -> HubSource:
    try:
        return parse_hub_uri(uri)
    except InvalidHubUri as error:
        raise SourceRefused(str(error), "traversal" if error.refusal is SourceRefusal.DOT_SEGMENT else "bad_uri") from None


def file_url(source: HubSource, endpoint: str, filename: str, commit: str | None = None) -> str:
    """The Hub's URL of one file at `commit` (default: the revision as given)."""
    return hf_hub_url(
        source.repo_id, filename, subfolder=source.subfolder or None, revision=commit or source.revision, endpoint=endpoint.rstrip("/")
    )


def pinned_commit(source: HubSource, answered: str | None, shown: str) -> str:
    """The commit both files are fetched at: the revision itself when it is one, else the commit
    the Hub answered for the first file; SourceRefused when it named none (a mirror that sends
    no X-Repo-Commit: then give a commit id)."""
    if source.pinned:
        return source.revision
    if answered is None or not is_commit(answered):
        raise SourceRefused(
            f"the hub did not name the commit of revision {source.revision!r} for {shown} (no valid {COMMIT_HEADER} "
            "header): give a commit id as @REVISION",
            "unpinned_revision",
        )
    return answered
