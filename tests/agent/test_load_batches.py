"""LoadAdapters on the shared agent (tp=2, dp=2): several loads in one call, each as LoadAdapter
would do it on its own (on every rank or none; one that fails fails alone, with the status and
reason LoadAdapter would have answered), one outcome per load in order, what the ranks hold
once for the call; more than the cap per call is refused whole."""

from __future__ import annotations

import grpc

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_common.wire import REASON_METADATA_KEY
from node_agent.server import MAX_LOADS_PER_CALL
from tests.agent.helpers import make_nan_adapter, rpc_error


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
