"""hf:// source URIs: which Hub repository, revision and folder one names, read once for both sides.

``hf://ORG/REPO[@REVISION][/SUBDIR]`` names the two adapter files of a Hub model repository
(``SUBDIR/adapter_config.json`` and ``SUBDIR/adapter_model.safetensors``). REVISION is a branch,
a tag or a commit id (default ``main``; a revision with a ``/``, such as ``refs/pr/1``, is
written percent-encoded, ``refs%2Fpr%2F1``). The operator admits an hf:// source by its
organisation and repository (``spec.sources.allow``); the agent fetches it at one commit
(`node_agent.sources.hub`). Both read the URI with `parse_hub_uri`, so a URI the agents refuse
is never admitted.

The repository-name rule is huggingface_hub's (``validate_repo_id``), written here without it:
the operator does not install huggingface_hub (a test checks both agree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from lorafleet_common.sources import HUB_SCHEME, SourceRefusal, redact_uri

PREFIX = f"{HUB_SCHEME}://"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Branch and tag names as git allows them, conservatively: no "..", no control characters.
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$")
# huggingface_hub's REPO_ID_REGEX ("namespace/name", each 1-96 ASCII letters, digits, '_', '-',
# '.', between word boundaries) with its extra rules: no "--" or "..", no ".git" at the end.
_REPO_ID = re.compile(r"^(?:\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b$", re.ASCII)


class InvalidHubUri(ValueError):
    """An hf:// URI that names no repository, revision or folder; `refusal` says which kind."""

    def __init__(self, message: str, refusal: SourceRefusal) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(frozen=True)
class HubSource:
    """An hf:// source: the repository, the revision as given, and the folder inside it."""

    repo_id: str  # ORG/REPO
    revision: str
    subfolder: str  # "" for the repository's top level

    @property
    def organisation(self) -> str:
        return self.repo_id.partition("/")[0]

    @property
    def repository(self) -> str:
        return self.repo_id.partition("/")[2]

    @property
    def pinned(self) -> bool:
        """Whether the revision is already a commit id (nothing to resolve)."""
        return is_commit(self.revision)


def is_commit(revision: str) -> bool:
    """Whether `revision` is a full commit id."""
    return bool(_COMMIT.match(revision))


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is no valid Hub repository name (None: it is one), in huggingface_hub's words."""
    if repo_id.count("/") > 1:
        return f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': {repo_id!r}."
    if not _REPO_ID.fullmatch(repo_id):
        return (
            "Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or end with '-' or '.' "
            f"and the maximum length is 96: {repo_id!r}."
        )
    if "--" in repo_id or ".." in repo_id:
        return f"Cannot have -- or .. in repo_id: {repo_id!r}."
    if repo_id.endswith(".git"):
        return f"Repo_id cannot end by '.git': {repo_id!r}."
    return None


def parse_hub_uri(uri: str) -> HubSource:
    """The repository, revision and folder of an hf:// URI; InvalidHubUri saying what is wrong
    (the URI shown redacted)."""
    shown = redact_uri(uri)
    if uri[: len(PREFIX)].lower() != PREFIX:
        raise InvalidHubUri(f"{shown!r} is not an hf:// URI: hf:// sources are hf://ORG/REPO[@REVISION][/SUBDIR]", SourceRefusal.INVALID)
    rest = uri[len(PREFIX) :]
    if "?" in rest or "#" in rest or "\x00" in rest:
        raise InvalidHubUri(f"hf:// sources have no query or fragment: {shown!r}", SourceRefusal.NOT_A_DIRECTORY)
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise InvalidHubUri(f"{shown!r} names no repository: hf:// sources are hf://ORG/REPO[@REVISION][/SUBDIR]", SourceRefusal.INVALID)
    name, _, revision = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    problem = repo_id_problem(repo_id)
    if problem is not None:
        raise InvalidHubUri(f"{shown!r} names no valid Hub repository: {problem}", SourceRefusal.INVALID)
    revision = unquote(revision) if revision else "main"
    if not _REVISION.match(revision) or ".." in revision or revision.endswith((".lock", "/")):
        raise InvalidHubUri(f"{shown!r}: {revision!r} is not a branch, tag or commit id", SourceRefusal.INVALID)
    folder = [unquote(segment) for segment in parts[2:] if segment]
    if any(segment in (".", "..") or "/" in segment or "\\" in segment for segment in folder):
        raise InvalidHubUri(f"'.' and '..' are refused in hf:// folders: {shown!r}", SourceRefusal.DOT_SEGMENT)
    return HubSource(repo_id, revision, "/".join(folder))
