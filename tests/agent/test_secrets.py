"""Secrets never reach logs, errors or metrics: a load with credentials in its URL is refused,
and the call log, every other log record, the gRPC error and the metrics omit the secret."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import generate_latest

from lorafleet.v1 import agent_pb2 as pb
from tests.agent.helpers import rpc_error

SECRET = "s3cr3t-h8-pa55"


def test_a_userinfo_url_is_refused_and_its_secret_appears_nowhere(shared, stub, caplog):
    caplog.set_level(logging.DEBUG)
    for uri in (f"http://user:{SECRET}@127.0.0.1:9/adapters/sql", f"file://u:{SECRET}@localhost/adapters/sql"):
        error = rpc_error(lambda uri=uri: stub.LoadAdapter(pb.LoadAdapterRequest(name="creds", source_uri=uri), timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "credentials" in error.details(), error.details()
        assert SECRET not in error.details()
    calls = [r for r in caplog.records if r.name == "lorafleet.agent.calls"]
    assert len(calls) == 2 and all('"outcome": "credentials"' in r.getMessage() for r in calls), [r.getMessage() for r in calls]
    assert all("***@" in r.getMessage() for r in calls), "the call log shows the URI, redacted"
    leaked = [r.getMessage() for r in caplog.records if SECRET in r.getMessage() or SECRET in str(r.args)]
    assert leaked == []
    assert SECRET.encode() not in generate_latest(shared.agent.metrics.registry)
