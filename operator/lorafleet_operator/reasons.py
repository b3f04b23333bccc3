"""Every reason the operator writes, in two enumerations (docs/operator.md): a condition's
(:class:`Reason`) and an Event's (:class:`EventReason`; a phase change's Event is the phase).

The values are the API: the strings in ``status.conditions[].reason`` of LoraAdapters and
LoraFleets and in Events, which users, alerts and tests read; a member's name says where it
applies.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """A condition's reason (Kubernetes API conventions: one CamelCase word)."""

    # A LoraAdapter's first visit, before any agent answered (Ready and Degraded Unknown).
    RECONCILING = "Reconciling"
    # LoraAdapter Ready, from the agents' results (status.py).
    ALL_AGENTS_LOADED = "AllAgentsLoaded"
    LOADING = "Loading"
    PARTIALLY_LOADED = "PartiallyLoaded"
    LOAD_FAILED = "LoadFailed"
    TERMINATING = "Terminating"
    #: No agent holds the adapter as specified, but some serve a previous version of it.
    PREVIOUS_VERSION_SERVED = "PreviousVersionServed"
    #: The generation's loads crashed agents (failures.CrashBook): sent to none.
    LOAD_CRASHED_AGENT = "LoadCrashedAgent"
    # LoraAdapter Ready while Pending: placement found no room, or fewer than spec.replicas.
    NO_TARGET_AGENTS = "NoTargetAgents"
    NO_ROOM = "NoRoom"
    NOT_ENOUGH_ROOM = "NotEnoughRoom"
    #: Every agent that would fit is closed to it by a quota of its namespace (spec.quotas).
    QUOTA_EXCEEDED = "QuotaExceeded"
    #: No agent has room now, and its namespace's guaranteed share (spec.quotas minSlots) is
    #: being taken back from other namespaces for it.
    AWAITING_GUARANTEED_SLOT = "AwaitingGuaranteedSlot"
    # LoraAdapter Ready while Pending: the fleet cannot be used, or does not admit it.
    FLEET_NOT_FOUND = "FleetNotFound"
    FLEET_DELETED = "FleetDeleted"
    SECRET_NOT_OPENED = "SecretNotOpened"
    INVALID_TOKEN = "InvalidToken"
    SOURCE_CREDENTIAL_REFUSED = "SourceCredentialRefused"
    PINNING_NOT_ALLOWED = "PinningNotAllowed"
    SOURCE_NOT_ALLOWED = "SourceNotAllowed"
    # LoraAdapter Degraded.
    NO_AGENT_FAILING = "NoAgentFailing"
    AGENTS_FAILING = "AgentsFailing"
    # LoraFleet Ready.
    NO_AGENTS = "NoAgents"
    ALL_AGENTS_READY = "AllAgentsReady"
    AGENTS_NOT_READY = "AgentsNotReady"


class EventReason(enum.StrEnum):
    """A Warning Event's reason (besides phase changes, whose reason is the new phase)."""

    #: A deletion gave up on some agents (the drift check unloads the orphans later).
    UNLOAD_INCOMPLETE = "UnloadIncomplete"
    #: The API server refused a status patch for what it is; it is not sent again.
    STATUS_REFUSED = "StatusRefused"
    #: A pod a fleet selects did not prove it is an agent holding the fleet's token.
    NOT_AN_AGENT = "NotAnAgent"
    #: A watched namespace is missing or forbidden (on the leader Lease).
    WATCHED_NAMESPACE_UNUSABLE = "WatchedNamespaceUnusable"
    #: Someone else changed or deleted one of the adapter's EndpointSlices: written again.
    ENDPOINT_SLICE_RESTORED = "EndpointSliceRestored"
    #: A slice claimed to be the adapter's (lorafleet's managed-by, or the adapter as its
    #: controller) but was not written by the operator: deleted.
    IMPOSTOR_ENDPOINT_SLICE_DELETED = "ImpostorEndpointSliceDeleted"
    #: A slice carries the adapter's label but is not lorafleet's: never trusted, left alone.
    UNTRUSTED_ENDPOINT_SLICE = "UntrustedEndpointSlice"
