"""The Kubernetes API calls the operator makes outside kopf's own (lists, status, secrets,
EndpointSlices).

The official client is synchronous, so each call runs in a worker thread; responses are read as
plain JSON dicts (``_preload_content=False``), the same shape kopf hands to handlers, instead of
the client's model classes. Every request has a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from lorafleet_operator import metrics
from lorafleet_operator.config import ADAPTERS, FLEETS, GROUP, VERSION

REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ConditionMessage:
    """Where a condition is in a stored status (its index in the list), its type and message."""

    index: int
    type: str
    message: str


@dataclass(frozen=True)
class SecretData:
    """What the operator reads of a Secret: who opened it (labels, annotations) and its data."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    data: Mapping[str, bytes] = field(default_factory=dict)


def make_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials inside a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        api = client.ApiClient()
    else:
        api = config.new_client_from_config(config_file=kubeconfig)
    # Many reconciles run at once (one kopf worker per object); the default pool of 4
    # connections would serialise them and warn.
    api.configuration.connection_pool_maxsize = 32
    api.rest_client.pool_manager.connection_pool_kw["maxsize"] = 32
    return api


def read_json(response: object) -> dict[str, Any]:
    """The JSON object of a raw response: a call made with ``_preload_content=False`` returns
    urllib3's response (not the client's model classes), read here as the API server's JSON."""
    if not isinstance(response, urllib3.BaseHTTPResponse):
        raise TypeError(f"expected a raw HTTP response, got {type(response).__name__}")
    body = json.loads(response.data)
    if not isinstance(body, dict):
        raise TypeError(f"expected a JSON object, got {type(body).__name__}")
    return body


class Kube:
    """Async wrappers over the calls the operator needs; every method returns JSON dicts."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.discovery = client.DiscoveryV1Api(api)

    async def _run(self, fn: Callable[..., object], *args: Any, **kwargs: Any) -> dict[str, Any]:
        metrics.KUBE_REQUESTS.labels(call=getattr(fn, "__name__", "")).inc()
        kwargs.setdefault("_preload_content", False)
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT_S)
        return read_json(await asyncio.to_thread(fn, *args, **kwargs))

    async def get_fleet(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._run(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, FLEETS, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    async def list_fleets(self, namespace: str) -> list[dict[str, Any]]:
        body = await self._run(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, FLEETS)
        return list(body.get("items") or [])

    async def get_adapter(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A LoraAdapter as stored now; None when it is gone."""
        try:
            return await self._run(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, ADAPTERS, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    async def list_adapters(self, namespace: str) -> list[dict[str, Any]]:
        body = await self._run(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, ADAPTERS)
        return list(body.get("items") or [])

    async def get_secret(self, namespace: str, name: str) -> SecretData:
        """A Secret's labels, annotations and data (decoded), read by name. Raises
        ApiException (404 when missing, 403 when the operator may not read it)."""
        body = await self._run(self.core.read_namespaced_secret, name, namespace)
        meta = body.get("metadata") or {}
        return SecretData(
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            data={k: base64.b64decode(v) for k, v in (body.get("data") or {}).items()},
        )

    async def namespace_problem(self, namespace: str) -> str:
        """What is wrong with a namespace to watch: "forbidden" (the operator may not list its
        LoraAdapters), "missing" (it does not exist), or "" (usable)."""
        try:
            await self._run(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, ADAPTERS, limit=1)
        except ApiException as err:
            if err.status == 403:
                return "forbidden"
            raise
        try:
            await self._run(self.core.read_namespace, namespace)
        except ApiException as err:
            if err.status == 404:
                return "missing"
            if err.status != 403:  # may not read namespaces: nothing more to learn
                raise
        return ""

    async def post_event(self, namespace: str, involved: Mapping[str, str], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about ``involved`` (apiVersion, kind, name, uid), outside kopf."""
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self._run(
            self.core.create_namespaced_event,
            namespace,
            {
                "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
                "involvedObject": {**involved, "namespace": namespace},
                "type": type_,
                "reason": reason,
                "message": message,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "source": {"component": "lorafleet-operator"},
                "reportingComponent": "lorafleet-operator",
            },
        )

    async def list_endpoint_slices(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        body = await self._run(self.discovery.list_namespaced_endpoint_slice, namespace, label_selector=label_selector)
        return list(body.get("items") or [])

    async def create_endpoint_slice(self, namespace: str, slice_: Mapping[str, Any]) -> dict[str, Any]:
        return await self._run(self.discovery.create_namespaced_endpoint_slice, namespace, dict(slice_))

    async def replace_endpoint_slice(self, namespace: str, name: str, slice_: Mapping[str, Any]) -> dict[str, Any]:
        return await self._run(self.discovery.replace_namespaced_endpoint_slice, name, namespace, dict(slice_))

    async def delete_endpoint_slice(self, namespace: str, name: str) -> None:
        """Delete an EndpointSlice; one already gone counts as deleted."""
        try:
            await self._run(self.discovery.delete_namespaced_endpoint_slice, name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    async def patch_adapter_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge-patch a LoraAdapter's status; None when the object is gone."""
        return await self._patch_status(ADAPTERS, namespace, name, status)

    async def replace_condition_message(self, namespace: str, name: str, at: ConditionMessage, message: str) -> bool:
        """Replace one condition's message of a LoraAdapter, only if that condition still is
        where ``at`` says with the message ``at`` says (a JSON patch whose ``test`` operations
        guard it): any other writer's newer condition is never written over. False when the
        guard failed or the object is gone."""
        path = f"/status/conditions/{at.index}"
        patch = [
            {"op": "test", "path": f"{path}/type", "value": at.type},
            {"op": "test", "path": f"{path}/message", "value": at.message},
            {"op": "replace", "path": f"{path}/message", "value": message},
        ]
        try:
            await self._run(
                self.custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                namespace,
                ADAPTERS,
                name,
                patch,
                _content_type="application/json-patch+json",
            )
        except ApiException as err:
            if err.status in (404, 422):  # gone, or a test operation failed: someone wrote since
                return False
            raise
        return True

    async def patch_fleet_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
        return await self._patch_status(FLEETS, namespace, name, status)

    async def _patch_status(self, plural: str, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            return await self._run(
                self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, plural, name, {"status": dict(status)}
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
