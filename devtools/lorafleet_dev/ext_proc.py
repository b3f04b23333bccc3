"""A client of envoy's external-processing protocol (``envoy.service.ext_proc.v3``) that stands in
for Envoy in front of an endpoint picker: it sends a request's headers and body, as Envoy's
ext_proc filter does, and reads which endpoint the picker chose (docs/gateway.md).

The messages come from ``ext_proc_v3.binpb``, the FileDescriptorSet ``scripts/build-epp.sh``
writes from the Go code in the EPP's own module graph (go-control-plane ships no ``.proto``
files): a descriptor pool of its own, so nothing is generated or imported, and the wire format
is exactly the EPP's. Messages are built from and read as their JSON forms
(``google.protobuf.json_format``), then turned into the plain values here.
"""

from __future__ import annotations

import base64
import json
import queue
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import Message

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
#: The header in which the picker names the chosen endpoint (``ip:port``); Envoy routes to it.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: Where a gateway puts the endpoints a request may go to (the GIE protocol's subset hint): filter
#: metadata of this namespace, a list of ``ip[:port]`` under the key below. Matched by IP.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
_REQUEST = "envoy.service.ext_proc.v3.ProcessingRequest"
_RESPONSE = "envoy.service.ext_proc.v3.ProcessingResponse"
_DONE = object()


@dataclass(frozen=True)
class Pick:
    """The picker's answer to one request: the endpoint, or its refusal (Envoy's immediate
    response, with the HTTP status and body it would send the client)."""

    endpoint: str | None
    refusal_status: int | None = None
    refusal_body: str = ""


@dataclass(frozen=True)
class ProxiedRequest:
    """One HTTP request as Envoy would hand it to the picker."""

    body: Mapping[str, Any]
    path: str = "/v1/completions"
    #: Endpoints (``ip:port``) the gateway allows, sent as the subset hint; empty: no hint.
    subset: Sequence[str] = ()


class _Messages:
    """The request and response classes of the ext_proc service, from the descriptor set."""

    def __init__(self, descriptors: Path) -> None:
        pool = descriptor_pool.DescriptorPool()
        # The set lists each file after the files it imports, the order a pool accepts.
        for file in descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file:
            pool.Add(file)
        self.request = message_factory.GetMessageClass(pool.FindMessageTypeByName(_REQUEST))
        self.response = message_factory.GetMessageClass(pool.FindMessageTypeByName(_RESPONSE))


def _raw(value: str) -> str:
    """A header value as the JSON form of ``HeaderValue.raw_value`` (bytes: base64)."""
    return base64.b64encode(value.encode()).decode()


def _phase_messages(request: ProxiedRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """The headers and body messages of one request, in JSON form. The picker reads the
    metadata of each message anew, so both carry the subset hint."""
    body = json.dumps(request.body).encode()
    headers = {":method": "POST", ":path": request.path, "content-type": "application/json", "content-length": str(len(body))}
    metadata = {"filter_metadata": {SUBSET_NAMESPACE: {SUBSET_KEY: list(request.subset)}}} if request.subset else {}
    header_message = {
        "request_headers": {"headers": {"headers": [{"key": k, "raw_value": _raw(v)} for k, v in headers.items()]}},
        "metadata_context": metadata,
    }
    body_message = {
        "request_body": {"body": base64.b64encode(body).decode(), "end_of_stream": True},
        "metadata_context": metadata,
    }
    return header_message, body_message


def _destination(header_response: Mapping[str, Any]) -> str | None:
    """The endpoint a ``request_headers`` response sets in :data:`DESTINATION_HEADER`."""
    mutation = header_response.get("response", {}).get("header_mutation", {})
    for entry in mutation.get("set_headers", []):
        header = entry.get("header", {})
        if header.get("key") == DESTINATION_HEADER:
            raw = header.get("raw_value")
            return base64.b64decode(raw).decode() if raw else str(header.get("value", ""))
    return None


def _refusal(immediate: Mapping[str, Any]) -> Pick:
    status = immediate.get("status", {}).get("code", "0")
    code = int(status) if str(status).isdigit() else 0
    return Pick(None, code, base64.b64decode(immediate.get("body", "")).decode(errors="replace"))


class ExtProcClient:
    """Envoy's side of the picker's ext_proc stream, one stream per request, over one channel."""

    def __init__(self, address: str, descriptors: Path) -> None:
        self._messages = _Messages(descriptors)
        self._channel = grpc.insecure_channel(address)
        self._process = self._channel.stream_stream(
            PROCESS_METHOD,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=self._messages.response.FromString,
        )

    def _message(self, form: Mapping[str, Any]) -> Message:
        return json_format.ParseDict(dict(form), self._messages.request())

    def pick(self, request: ProxiedRequest, timeout_s: float = 60.0) -> Pick:
        """Send the request's headers and body; the endpoint the picker sets for it (or its
        refusal). The stream stays open until the answer is read, as Envoy keeps it."""
        outgoing: queue.Queue[object] = queue.Queue()

        def requests() -> Iterator[object]:
            while (item := outgoing.get()) is not _DONE:
                yield item

        for form in _phase_messages(request):
            outgoing.put(self._message(form))
        responses = self._process(requests(), timeout=timeout_s)
        try:
            return self._read_pick(responses)
        finally:
            outgoing.put(_DONE)
            responses.cancel()

    def _read_pick(self, responses: Iterator[Message]) -> Pick:
        """Read answers until the picker set a destination and let the body through, or refused."""
        endpoint = None
        for response in responses:
            form = json_format.MessageToDict(response, preserving_proto_field_name=True)
            if "immediate_response" in form:
                return _refusal(form["immediate_response"])
            if "request_headers" in form:
                endpoint = _destination(form["request_headers"])
            if "request_body" in form:
                return Pick(endpoint)
        return Pick(endpoint)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()
