"""LoraAdapters and LoraFleets as frozen values, parsed once where kopf (or a list call) hands
them over (:func:`adapter_of`, :func:`fleet_of`); everything inward reads typed fields.

The stored ``status`` stays a mapping: it is what a new status is compared with and written
over as a merge patch (:mod:`~lorafleet_operator.publish`).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import kopf

from lorafleet_operator import names
from lorafleet_operator.config import GROUP, VERSION

#: (adapter uid, generation): one generation of one LoraAdapter (what a crash counts against).
AdapterGeneration = tuple[str, int]
#: (adapter uid, generation, agent pod): one adapter generation on one agent (its back-off).
FailureKey = tuple[str, int, str]


@dataclass(frozen=True)
class ObjectRef:
    """What an Event or a status patch needs to name one object."""

    kind: str
    namespace: str
    name: str
    uid: str = ""

    def to_reference(self) -> kopf.RawBody:
        """The object as kopf's Events refer to it: apiVersion, kind and metadata."""
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": self.kind,
            "metadata": {"namespace": self.namespace, "name": self.name, "uid": self.uid},
        }


@dataclass(frozen=True)
class SourceCredentialsRef:
    """``spec.source.credentials``: its type and Secret ("" where the spec leaves them out:
    :mod:`~lorafleet_operator.credentials` applies the defaults)."""

    type: str
    secret: str
    key: str = ""


@dataclass(frozen=True)
class Source:
    """``spec.source``: where the adapter's files are, their digest ("" when not given), and
    the credential to fetch them with."""

    uri: str
    sha256: str = ""
    credentials: SourceCredentialsRef | None = None


class ScalingMetric(enum.StrEnum):
    """What ``spec.scaling.target`` counts per replica."""

    REQUESTS = "Requests"
    TOKENS_PER_SECOND = "TokensPerSecond"


@dataclass(frozen=True)
class ScalingSpec:
    """``spec.scaling``: replicas that follow demand (the CRD's defaults applied)."""

    min_replicas: int
    max_replicas: int
    metric: ScalingMetric
    per_replica: float
    scale_down_window_s: int = 300
    scale_up_replicas: int = 4
    scale_up_period_s: int = 15
    #: The time constant demand is averaged over (0: each sample as it is).
    smoothing_s: int = 150


@dataclass(frozen=True)
class AdapterSpec:
    """A LoraAdapter's ``spec``."""

    fleet: str
    base_model: str
    source: Source
    pinned: bool = False
    #: None: every fitting agent with room.
    replicas: int | None = None
    #: The adapter's LoRA rank when the spec states it.
    rank: int | None = None
    #: Replicas that follow demand (None: ``replicas`` decides).
    scaling: ScalingSpec | None = None

    @property
    def standby(self) -> bool:
        """On standby where not resident (``spec.scaling.minReplicas: 0``): held on disk by
        every agent of the fleet that serves its base model, loaded to a slot on demand."""
        return self.scaling is not None and self.scaling.min_replicas == 0


@dataclass(frozen=True)
class AdapterObject:
    """One LoraAdapter as a handler or the drift check received it."""

    namespace: str
    name: str
    spec: AdapterSpec
    uid: str = ""
    generation: int = 0
    #: metadata.creationTimestamp ("" when absent): placement's creation order.
    created: str = ""
    #: metadata.deletionTimestamp is set.
    deleting: bool = False
    #: The status as stored (empty before the first write).
    status: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> ObjectRef:
        return ObjectRef("LoraAdapter", self.namespace, self.name, self.uid)

    @property
    def agent_name(self) -> str:
        """Its name in an agent's registry (:func:`~lorafleet_operator.names.agent_name`)."""
        return names.agent_name(self.namespace, self.name)

    @property
    def generation_key(self) -> AdapterGeneration:
        return (self.uid, self.generation)

    def failure_key(self, pod: str) -> FailureKey:
        """The back-off key of this generation on one agent."""
        return (self.uid, self.generation, pod)

    @property
    def placed(self) -> tuple[str, ...]:
        """The pods of its last placement, as the stored status says."""
        return tuple((self.status.get("placement") or {}).get("placed") or ())

    def with_status(self, status: Mapping[str, Any]) -> AdapterObject:
        """The same object with ``status`` as its stored status."""
        return replace(self, status=status)


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the object's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class TlsRef:
    """``spec.tls``: the Secret with ``ca.crt`` (and a client pair), and the name to verify."""

    secret: str
    server_name: str = ""


@dataclass(frozen=True)
class SlotQuota:
    """One namespace's limit of ``spec.quotas``: at most ``max_slots`` slots (adapter × agent
    placements) on the fleet's agents; ``field`` is where the fleet states it."""

    max_slots: int
    field: str


@dataclass(frozen=True)
class Quotas:
    """``spec.quotas``: a limit per namespace named, and one for every other (None: none)."""

    default: int | None = None
    #: (namespace, maxSlots) in the spec's order.
    namespaces: tuple[tuple[str, int], ...] = ()
    #: (namespace, minSlots) of the entries that guarantee a share (minSlots > 0).
    guarantees: tuple[tuple[str, int], ...] = ()

    def __bool__(self) -> bool:
        return self.default is not None or bool(self.namespaces)

    def of(self, namespace: str) -> SlotQuota | None:
        """The limit that applies to ``namespace`` (None: no limit)."""
        for named, max_slots in self.namespaces:
            if named == namespace:
                return SlotQuota(max_slots, f"spec.quotas.namespaces[namespace={namespace}]")
        return None if self.default is None else SlotQuota(self.default, "spec.quotas.default")


@dataclass(frozen=True)
class FleetSpec:
    """A LoraFleet's ``spec`` ("" for a port or Service name the spec leaves out: the
    modules that use them hold the defaults, which the CRD repeats)."""

    selector: Mapping[str, Any] = field(default_factory=dict)
    grpc_port_name: str = ""
    service_name: str = ""
    http_port_name: str = ""
    token: SecretKeyRef | None = None
    tls: TlsRef | None = None
    pinning_allowed: bool = False
    #: ``spec.sources.allow``: the http(s) and hf:// prefixes the fleet's owner admits.
    source_prefixes: tuple[str, ...] = ()
    #: ``spec.quotas``: slots per namespace on the fleet's agents (docs/operator.md, Security).
    quotas: Quotas = field(default_factory=Quotas)

    @property
    def agent_secrets(self) -> frozenset[str]:
        """The Secrets the fleet itself uses towards its agents (token, TLS)."""
        return frozenset(n for n in (self.token.name if self.token else "", self.tls.secret if self.tls else "") if n)


@dataclass(frozen=True)
class FleetObject:
    """One LoraFleet as kopf's index, a daemon or a list call has it."""

    namespace: str
    name: str
    spec: FleetSpec
    uid: str = ""
    generation: int = 0
    deleting: bool = False
    #: The status as stored (empty in kopf's fleet index, which drops it).
    status: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> ObjectRef:
        return ObjectRef("LoraFleet", self.namespace, self.name, self.uid)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def adapter_spec_of(spec: Mapping[str, Any]) -> AdapterSpec:
    """A LoraAdapter's ``spec`` as the API server stores it (the CRD's required fields set)."""
    source = spec["source"]
    creds = source.get("credentials")
    return AdapterSpec(
        fleet=str(spec["fleetRef"]["name"]),
        base_model=str(spec["baseModel"]),
        source=Source(
            uri=str(source["uri"]),
            sha256=str(source.get("sha256") or ""),
            credentials=(
                SourceCredentialsRef(
                    str(creds.get("type") or ""), str(creds["secretRef"]["name"]), str(creds["secretRef"].get("key") or "")
                )
                if creds
                else None
            ),
        ),
        pinned=bool(spec.get("pinned", False)),
        replicas=_optional_int(spec.get("replicas")),
        rank=_optional_int(spec.get("rank")),
        scaling=scaling_spec_of(spec["scaling"]) if spec.get("scaling") else None,
    )


def scaling_spec_of(scaling: Mapping[str, Any]) -> ScalingSpec:
    """``spec.scaling`` as the API server stores it (required fields set, defaults applied;
    the same defaults here for a body that skipped them)."""
    behavior = scaling.get("behavior") or {}
    down, up = behavior.get("scaleDown") or {}, behavior.get("scaleUp") or {}
    target = scaling["target"]
    return ScalingSpec(
        min_replicas=int(scaling.get("minReplicas", 1)),
        max_replicas=int(scaling["maxReplicas"]),
        metric=ScalingMetric(target.get("metric") or ScalingMetric.REQUESTS),
        per_replica=float(target["perReplica"]),
        scale_down_window_s=int(down.get("stabilizationWindowSeconds", 300)),
        scale_up_replicas=int(up.get("replicas", 4)),
        scale_up_period_s=int(up.get("periodSeconds", 15)),
        smoothing_s=int(behavior.get("demandSmoothingSeconds", 150)),
    )


def adapter_of(body: Mapping[str, Any]) -> AdapterObject:
    """A LoraAdapter body (kopf's, or a list call's item) as a value."""
    meta = body["metadata"]
    return AdapterObject(
        namespace=str(meta["namespace"]),
        name=str(meta["name"]),
        spec=adapter_spec_of(body["spec"]),
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation", 0)),
        created=str(meta.get("creationTimestamp", "")),
        deleting=bool(meta.get("deletionTimestamp")),
        status=dict(body.get("status") or {}),
    )


def fleet_spec_of(spec: Mapping[str, Any]) -> FleetSpec:
    """A LoraFleet's ``spec`` (the selector copied: kopf may reuse the body it came from)."""
    auth, tls, routing = spec.get("auth") or {}, spec.get("tls") or {}, spec.get("routing") or {}
    token = auth.get("tokenSecretRef")
    return FleetSpec(
        selector=copy.deepcopy(dict(spec.get("selector") or {})),
        grpc_port_name=str(spec.get("grpcPortName") or ""),
        service_name=str(routing.get("serviceName") or ""),
        http_port_name=str(routing.get("httpPortName") or ""),
        token=SecretKeyRef(str(token["name"]), str(token.get("key") or "token")) if token else None,
        tls=TlsRef(str(tls["secretRef"]["name"]), str(tls.get("serverName", ""))) if tls else None,
        pinning_allowed=bool((spec.get("pinning") or {}).get("allowed")),
        source_prefixes=tuple(str(p) for p in (spec.get("sources") or {}).get("allow") or ()),
        quotas=quotas_of(spec.get("quotas") or {}),
    )


def quotas_of(quotas: Mapping[str, Any]) -> Quotas:
    """A LoraFleet's ``spec.quotas`` as the API server stores it (the CRD's required fields set)."""
    default = quotas.get("default")
    return Quotas(
        default=None if default is None else int(default["maxSlots"]),
        namespaces=tuple((str(q["namespace"]), int(q["maxSlots"])) for q in quotas.get("namespaces") or ()),
        guarantees=tuple((str(q["namespace"]), int(q["minSlots"])) for q in quotas.get("namespaces") or () if q.get("minSlots")),
    )


def fleet_of(body: Mapping[str, Any]) -> FleetObject:
    """A LoraFleet body (kopf's, or a list call's item) as a value."""
    meta = body.get("metadata") or {}
    return FleetObject(
        namespace=str(meta.get("namespace", "")),
        name=str(meta["name"]),
        spec=fleet_spec_of(body.get("spec") or {}),
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation", 0)),
        deleting=bool(meta.get("deletionTimestamp")),
        status=dict(body.get("status") or {}),
    )
