"""The refusals a backend answers with, one class per thing its caller does differently.

A backend raises these and nothing else across the seam; the agent maps each to its own domain
error (`node_agent.errors`).
"""

from __future__ import annotations

from node_agent.backend.replies import ControlResult


class BackendError(RuntimeError):
    """The backend cannot do what was asked (it failed, a rank is gone, an unknown adapter)."""


class Unsupported(BackendError):
    """The backend has no such capability (Forward on a server without logits, pinning, ...)."""


class SequenceAborted(BackendError):
    """A generation ended because its adapter was unloaded under it (a drain that timed out)."""


class AdapterRefused(ValueError):
    """The adapter itself was refused before any rank was asked; the message says why."""


class SnapshotChanged(AdapterRefused):
    """The adapter's files changed after they were verified: fetch them again."""


class RequestRefused(ValueError):
    """A request the backend can never serve as asked (sampling out of range, too long to fit)."""


class Overloaded(BackendError):
    """The backend's queue is full: retry later."""


class LoadFailed(Exception):
    """Some ranks refused a load and the others dropped it again; `result` has every rank's answer."""

    def __init__(self, result: ControlResult) -> None:
        super().__init__(result.error)
        self.result = result


class UnloadFailed(BackendError):
    """Some ranks failed an unload (the name is gone either way); `result` has every rank's answer."""

    def __init__(self, result: ControlResult) -> None:
        super().__init__(result.error)
        self.result = result
