"""The engine's refusals, each one of the seam's (`node_agent.backend`), so a caller of either
catches the same classes."""

from __future__ import annotations

from node_agent import backend
from node_agent.backend import ControlResult
from node_agent.engine.adapters.errors import AdapterLoadError


class EngineError(backend.BackendError):
    """The engine cannot do what was asked (startup failure, dead rank, unknown adapter)."""


class SequenceAborted(EngineError, backend.SequenceAborted):
    """A generation ended because its adapter was unloaded under it (a drain that timed out)."""


class RankLoadError(AdapterLoadError, backend.LoadFailed):
    """Some ranks refused a load (the others rolled it back); `result` holds every rank's answer."""

    def __init__(self, result: ControlResult) -> None:
        backend.LoadFailed.__init__(self, result)


class RankUnloadError(EngineError, backend.UnloadFailed):
    """Some ranks failed an unload; `result` holds every rank's answer."""

    def __init__(self, result: ControlResult) -> None:
        backend.UnloadFailed.__init__(self, result)
