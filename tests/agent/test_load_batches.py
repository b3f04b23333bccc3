"""LoadAdapters on the shared agent (tp=2, dp=2): several loads in one call, each as LoadAdapter
would do it on its own (on every rank or none; one that fails fails alone, with the status and
reason LoadAdapter would have answered), one outcome per load in order, what the ranks hold
once for the call; more than the cap per call is refused whole."""

from __future__ import annotations

import logging

import grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_common.wire import REASON_METADATA_KEY
from node_agent.server import MAX_LOADS_PER_CALL
from tests.agent.helpers import http_server, make_nan_adapter, rpc_error, wait_until


def request(name: str, path) -> pb.LoadAdapterRequest:
    return pb.LoadAdapterRequest(name=name, source_uri=path.as_uri())


def listed(stub) -> set[str]:
    return {a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}


def test_a_batch_loads_each_item_on_its_own_and_a_bad_one_fails_alone(shared, stub):
    refused_by_ranks = make_nan_adapter(shared.root / "batch-nan", seed=11)
    loads = [
        request("batch-a", shared.adapters["ad0"]),
        request("../bad-name", shared.adapters["ad1"]),
        request("batch-nan", refused_by_ranks),
        request("batch-b", shared.adapters["ad2"]),
        request("batch-missing", shared.root / "no-such-adapter"),
    ]
    reply = stub.LoadAdapters(pb.LoadAdaptersRequest(loads=loads), timeout=120)

    assert len(reply.outcomes) == len(loads)
    good_a, bad_name, nan, good_b, missing = reply.outcomes
    for good in (good_a, good_b):
        assert good.code == grpc.StatusCode.OK.value[0] and good.reply.success
        assert [r.success for r in good.reply.rank_results] == [True, True]
    # What LoadAdapter answers for each of them alone: a status and the agent's reason ...
    single = rpc_error(lambda: stub.LoadAdapter(loads[1], timeout=30))
    assert (bad_name.code, bad_name.error_message) == (single.code().value[0], single.details())
    assert (REASON_METADATA_KEY, bad_name.reason) in tuple(single.trailing_metadata())
    assert missing.code == grpc.StatusCode.NOT_FOUND.value[0] and missing.reason == "source_not_found", missing
    # ... or a reply whose ranks refused it (rolled back: on none of them).
    assert nan.code == grpc.StatusCode.OK.value[0] and not nan.reply.success
    assert "non-finite" in nan.reply.error_message
    assert [r.success for r in nan.reply.rank_results] == [False, False]
    assert listed(stub) == {"batch-a", "batch-b"}
    # What the ranks hold is listed once for the call: after its last load that reached them
    # (batch-b; the missing source never did), not in every load's reply.
    assert list(reply.loaded_adapters) == ["batch-a", "batch-b"]
    assert [list(o.reply.loaded_adapters) for o in reply.outcomes] == [[]] * len(loads)


def test_a_batch_over_the_cap_is_refused_whole(shared, stub):
    loads = [request(f"over-{i}", shared.adapters[f"ad{i % 10}"]) for i in range(MAX_LOADS_PER_CALL + 1)]
    error = rpc_error(lambda: stub.LoadAdapters(pb.LoadAdaptersRequest(loads=loads), timeout=60))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_LOADS_PER_CALL} per call" in error.details() and "nothing was loaded" in error.details()
    assert (REASON_METADATA_KEY, "invalid_request") in tuple(error.trailing_metadata())
    assert listed(stub) == set()


def test_a_batch_past_its_deadline_stops_its_download_and_starts_no_further_load(shared, stub, caplog):
    """Ten slow sources and a short client deadline: the download running at the deadline is
    stopped (its socket shut), no later load starts, nothing is loaded; the agent loads as before."""
    with http_server(shared.root) as http:
        loads = [pb.LoadAdapterRequest(name=f"slow-{i}", source_uri=http.url("hold", f"ad{i}")) for i in range(10)]
        call = stub.LoadAdapters.future(pb.LoadAdaptersRequest(loads=loads), timeout=2)
        line = batch_ended(shared, caplog, http, call, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert line.endswith(f"with 1 of 10 loads tried: loaded and kept: none; not loaded: {', '.join(load.name for load in loads)}")
    assert {path.split("/")[2] for path in http.requests} == {"ad0"}, "only the first source was asked for"
    assert listed(stub) == set() and not list(shared.cache.glob("dl-*"))
    assert stub.LoadAdapter(request("after-deadline", shared.adapters["ad3"]), timeout=60).success


def test_a_cancelled_batch_keeps_the_loads_done_before_and_names_them(shared, stub, caplog):
    """Two quick loads, then slow ones; the client cancels while the first slow one downloads: the
    two quick ones stay loaded, as LoadAdapter's would (docs/agent.md), and the log names them."""
    with http_server(shared.root) as http:
        quick = [pb.LoadAdapterRequest(name=f"early-{i}", source_uri=http.url("files", f"ad{i}")) for i in range(2)]
        held = [pb.LoadAdapterRequest(name=f"held-{i}", source_uri=http.url("hold", f"ad{i}")) for i in range(2, 10)]
        call = stub.LoadAdapters.future(pb.LoadAdaptersRequest(loads=quick + held), timeout=120)
        wait_until(lambda: http.holding == 1, 60, "the first slow download")
        call.cancel()
        line = batch_ended(shared, caplog, http, call, grpc.StatusCode.CANCELLED)
    assert line.endswith(
        f"with 3 of 10 loads tried: loaded and kept: early-0, early-1; not loaded: {', '.join(load.name for load in held)}"
    )
    assert {path.split("/")[2] for path in http.requests if path.startswith("/hold/")} == {"ad2"}
    assert listed(stub) == {"early-0", "early-1"}
    assert len(list(shared.cache.glob("dl-*"))) == 2, "the kept loads' downloads, no other"


def batch_ended(shared, caplog, http, call, code: grpc.StatusCode) -> str:
    """Wait until the agent has stopped the batch `call` (which ended with `code`) while its
    server still holds a download, then release the server; the agent's log line about it."""
    caplog.set_level(logging.WARNING, logger="node_agent.server")
    before = cancelled_loads(shared)
    try:
        assert call.cancelled() if code == grpc.StatusCode.CANCELLED else rpc_error(call.result).code() == code
        wait_until(lambda: ended_batches(caplog), 60, "the batch to stop")
        assert not shared.agent.downloading, "the running download was stopped"
        assert cancelled_loads(shared) == before + 1, "one load was stopped by the cancellation"
    finally:
        http.release.set()
    (line,) = ended_batches(caplog)
    return line


def ended_batches(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoadAdapters ended by its caller")]


def cancelled_loads(shared) -> float:
    return (
        shared.agent.metrics.registry.get_sample_value("lorafleet_agent_failures_total", {"operation": "load", "reason": "cancelled"}) or 0
    )
