"""What crosses the wire between agent and operator beside the `lorafleet.v1` messages."""

from __future__ import annotations

#: Trailing-metadata key with which an agent marks an error as its own answer; the value is the
#: error's reason (e.g. ``download_failed``). A transport failure or a deadline carries none,
#: which is how the operator tells "the agent refused" from "the agent died during the call".
REASON_METADATA_KEY = "lorafleet-reason"
