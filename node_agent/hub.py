"""hf:// adapter sources: a repository of the Hugging Face Hub (or a mirror) at a pinned commit.

``hf://ORG/REPO[@REVISION][/SUBDIR]`` names the two adapter files of a Hub model repository
(``SUBDIR/adapter_config.json`` and ``SUBDIR/adapter_model.safetensors``). REVISION is a branch,
a tag or a commit id (default ``main``; a revision with a ``/``, such as ``refs/pr/1``, is
written percent-encoded, ``refs%2Fpr%2F1``). A branch or tag is pinned to the commit the Hub
names for the first file (its ``X-Repo-Commit`` header), and the second file is fetched at that
commit, so both files always come from one commit even while the branch moves.

The repository-name rules and the URL layout are huggingface_hub's (`validate_repo_id`,
`hf_hub_url`). The bytes travel through the agent's own checked downloader (`sources.py`), so an
hf:// source gets every check an http(s) source gets: the URL (the endpoint's, set by the
fleet's owner with ``--hub-endpoint``, never by a request) and every redirect hop must be under
an ``--allow-source`` prefix, addresses are checked, the size is capped, a deadline and a
minimum rate apply, the sha256 is computed, pickle is never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from huggingface_hub import hf_hub_url
from huggingface_hub.errors import HFValidationError

# Public as huggingface_hub.utils.validate_repo_id; imported from its module for the type checker.
from huggingface_hub.utils._validators import validate_repo_id

from node_agent.errors import SourceRefused

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
COMMIT_HEADER = "X-Repo-Commit"  # the commit the Hub resolved a revision to
SCHEME = "hf://"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Branch and tag names as git allows them, conservatively: no "..", no control characters.
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$")


@dataclass(frozen=True)
class HubSource:
    """An hf:// source: the repository, the revision as given, and the folder inside it."""

    repo_id: str
    revision: str
    subfolder: str  # "" for the repository's top level

    @property
    def pinned(self) -> bool:
        """Whether the revision is already a commit id (nothing to resolve)."""
        return bool(_COMMIT.match(self.revision))

    def file_url(self, endpoint: str, filename: str, commit: str | None = None) -> str:
        """The Hub's URL of one file at `commit` (default: the revision as given)."""
        return hf_hub_url(
            self.repo_id, filename, subfolder=self.subfolder or None, revision=commit or self.revision, endpoint=endpoint.rstrip("/")
        )


def parse_hub_uri(uri: str, shown: str) -> HubSource:
    """The repository, revision and folder of an hf:// URI; SourceRefused naming what is wrong."""
    rest = uri[len(SCHEME) :]
    if "?" in rest or "#" in rest or "\x00" in rest:
        raise SourceRefused(f"hf:// sources have no query or fragment: {shown!r}", "bad_uri")
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise SourceRefused(f"{shown!r} names no repository: hf:// sources are hf://ORG/REPO[@REVISION][/SUBDIR]", "bad_uri")
    name, _, revision = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise SourceRefused(f"{shown!r} names no valid Hub repository: {error}", "bad_uri") from None
    revision = unquote(revision) if revision else "main"
    if not _REVISION.match(revision) or ".." in revision or revision.endswith((".lock", "/")):
        raise SourceRefused(f"{shown!r}: {revision!r} is not a branch, tag or commit id", "bad_uri")
    folder = [unquote(segment) for segment in parts[2:] if segment]
    if any(segment in (".", "..") or "/" in segment or "\\" in segment for segment in folder):
        raise SourceRefused(f"'.' and '..' are refused in hf:// folders: {shown!r}", "traversal")
    return HubSource(repo_id, revision, "/".join(folder))


def pinned_commit(source: HubSource, answered: str | None, shown: str) -> str:
    """The commit both files are fetched at: the revision itself when it is one, else the commit
    the Hub answered for the first file; SourceRefused when it named none (a mirror that sends
    no X-Repo-Commit: then give a commit id)."""
    if source.pinned:
        return source.revision
    if answered is None or not _COMMIT.match(answered):
        raise SourceRefused(
            f"the hub did not name the commit of revision {source.revision!r} for {shown} (no valid {COMMIT_HEADER} "
            "header): give a commit id as @REVISION",
            "unpinned_revision",
        )
    return answered
