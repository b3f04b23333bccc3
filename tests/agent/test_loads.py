"""Load semantics on the shared agent: idempotence, replace, drains, concurrency, serialisation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from lorafleet.v1 import agent_pb2 as pb
from tests.agent.helpers import forward, generate, http_server, make_adapter, make_nan_adapter, rpc_error, wait_until

PROMPT = [4, 8, 15, 16, 23, 42]


def load(stub, name: str, uri: str, **kwargs) -> pb.LoadAdapterResponse:
    return stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source_uri=uri, **kwargs), timeout=120)


def sha256(adapter_dir) -> str:
    return hashlib.sha256((adapter_dir / "adapter_model.safetensors").read_bytes()).hexdigest()


def listed(stub) -> dict[str, pb.AdapterInfo]:
    return {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}


def test_loading_the_same_name_and_content_again_does_no_work(shared, stub, tmp_path):
    path = shared.adapters["ad0"]
    assert load(stub, "same", path.as_uri()).success
    engine_name = shared.agent.registry.get("same").engine_name
    again = load(stub, "same", path.as_uri())
    assert again.success and again.already_loaded and list(again.loaded_adapters) == ["same"]
    assert [r.success for r in again.rank_results] == [True, True]
    copy = shutil.copytree(path, shared.root / "ad0-copy", dirs_exist_ok=True)  # same content, other URI
    moved = load(stub, "same", copy.as_uri(), sha256=sha256(path).upper())
    assert moved.success and moved.already_loaded
    assert shared.agent.registry.get("same").engine_name == engine_name, "no new version was loaded"
    assert listed(stub)["same"].source_uri == copy.as_uri(), "the registry records the latest source"


def test_a_promised_sha256_that_matches_skips_the_download(shared, stub):
    with http_server(shared.root) as server:
        uri, digest = server.url("files", "ad1"), sha256(shared.adapters["ad1"])
        assert load(stub, "fetched", uri, sha256=digest).success
        fetches = len(server.requests)
        assert fetches == 2, "adapter_config.json and adapter_model.safetensors"
        assert load(stub, "fetched", uri, sha256=digest).already_loaded
        assert len(server.requests) == fetches, "same URI, digest and pinning: nothing fetched"
        assert load(stub, "fetched", uri).already_loaded, "without a digest it fetches and compares"
        assert len(server.requests) == fetches + 2
    assert not list(shared.cache.glob("dl-*"))[1:], "the redundant downloads were removed"


def test_other_content_under_a_loaded_name_needs_replace(shared, stub):
    old, new = shared.adapters["ad2"], shared.adapters["ad3"]
    assert load(stub, "conflict", old.as_uri()).success
    assert load(stub, "conflict-old", old.as_uri()).success
    error = rpc_error(lambda: load(stub, "conflict", new.as_uri()))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "other content" in error.details() and "replace" in error.details()
    error = rpc_error(lambda: load(stub, "conflict", old.as_uri(), pinned=True))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "pinned=False" in error.details()
    served, reference = forward(stub, (PROMPT, "conflict"), (PROMPT, "conflict-old"))
    np.testing.assert_array_equal(served, reference)
    assert listed(stub)["conflict"].sha256 == sha256(old)
    repinned = load(stub, "conflict", old.as_uri(), pinned=True, replace=True)
    assert repinned.success and not repinned.already_loaded and listed(stub)["conflict"].pinned


def test_a_replacement_the_ranks_refuse_leaves_the_old_version_serving(shared, stub):
    bad = make_nan_adapter(shared.root / "nan-replacement", seed=9)
    assert load(stub, "kept", shared.adapters["ad4"].as_uri()).success
    before = forward(stub, (PROMPT, "kept"))[0]
    reply = load(stub, "kept", bad.as_uri(), replace=True)
    assert not reply.success and "non-finite" in reply.error_message and list(reply.loaded_adapters) == ["kept"]
    np.testing.assert_array_equal(forward(stub, (PROMPT, "kept"))[0], before)
    assert listed(stub)["kept"].sha256 == sha256(shared.adapters["ad4"])


def test_a_replacement_refused_by_validation_leaves_the_old_version_serving(shared, stub):
    bad = make_adapter(shared.root / "dora-replacement", seed=9)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert load(stub, "kept-too", shared.adapters["ad4"].as_uri()).success
    before = forward(stub, (PROMPT, "kept-too"))[0]
    error = rpc_error(lambda: load(stub, "kept-too", bad.as_uri(), replace=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "DoRA" in error.details()
    np.testing.assert_array_equal(forward(stub, (PROMPT, "kept-too"))[0], before)
    assert listed(stub)["kept-too"].sha256 == sha256(shared.adapters["ad4"])


def test_replace_swaps_at_once_while_a_running_request_finishes_on_the_old_weights(shared, stub):
    old, new = shared.adapters["ad5"], shared.adapters["ad6"]
    for name, path in (("live", old), ("old-copy", old), ("new-copy", new)):
        assert load(stub, name, path.as_uri()).success
    old_engine_name = shared.agent.registry.get("live").engine_name
    n = 100
    stream = stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter="live", max_new_tokens=n), timeout=300)
    tokens = [next(stream).token_id]  # the request is running on the old version
    with ThreadPoolExecutor(1) as pool:
        replacing = pool.submit(load, stub, "live", new.as_uri(), replace=True)
        wait_until(lambda: listed(stub)["live"].sha256 == sha256(new), what="the swap")
        # Premise: the stream still runs on the old version, and the replace waits for it.
        assert shared.agent.registry.in_flight(old_engine_name) == 1 and not replacing.done()
        during, new_reference = forward(stub, (PROMPT, "live"), (PROMPT, "new-copy"))
        np.testing.assert_array_equal(during, new_reference, "new requests use the new version at once")
        tokens += [reply.token_id for reply in stream]
        reply = replacing.result(timeout=120)
    assert reply.success and not reply.already_loaded and list(reply.loaded_adapters).count("live") == 1
    assert len(tokens) == n
    assert tokens == generate(stub, PROMPT, "old-copy", n), "the running request finished on the old weights"
    assert tokens != generate(stub, PROMPT, "new-copy", n), "premise: old and new weights generate differently"
    assert old_engine_name not in shared.engine.adapters, "the old version was unloaded after the drain"


def test_unload_refuses_new_requests_at_once_and_waits_for_running_ones(shared, stub):
    assert load(stub, "leaving", shared.adapters["ad7"].as_uri()).success
    engine_name = shared.agent.registry.get("leaving").engine_name
    n = 60
    stream = stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter="leaving", max_new_tokens=n), timeout=300)
    replies = [next(stream)]
    with ThreadPoolExecutor(1) as pool:
        unloading = pool.submit(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="leaving"), timeout=120))
        wait_until(lambda: "leaving" not in listed(stub), what="the adapter to stop routing")
        started = time.monotonic()
        error = rpc_error(lambda: forward(stub, (PROMPT, "leaving")))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "being unloaded" in error.details()
        assert time.monotonic() - started < 10, "refused at once, not after the drain"
        assert shared.agent.registry.in_flight(engine_name) == 1 and not unloading.done(), "the unload waits"
        replies += list(stream)
        reply = unloading.result(timeout=120)
    assert len(replies) == n and replies[-1].finish_reason == "length", "the running request completed"
    assert reply.success and "leaving" not in reply.loaded_adapters
    assert engine_name not in shared.engine.adapters
    error = rpc_error(lambda: forward(stub, (PROMPT, "leaving")))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "is not loaded" in error.details()


def test_a_request_still_running_after_the_drain_timeout_is_aborted(shared, stub, monkeypatch):
    monkeypatch.setattr(shared.agent, "config", dataclasses.replace(shared.agent.config, drain_timeout_s=0.5))
    assert load(stub, "cut", shared.adapters["ad8"].as_uri()).success
    stream = stub.Generate(pb.GenerateRequest(token_ids=PROMPT, adapter="cut", max_new_tokens=1000), timeout=300)
    next(stream)
    reply = stub.UnloadAdapter(pb.UnloadAdapterRequest(name="cut"), timeout=120)
    assert reply.success
    error = rpc_error(lambda: list(stream))
    assert error.code() == grpc.StatusCode.ABORTED and "'cut' was unloaded while the request ran" in error.details()


def test_eight_adapters_load_concurrently(shared, stub):
    names = [f"ad{i}" for i in range(8)]
    with http_server(shared.root) as server:
        # Every fetch waits until all eight loads are fetching: serialised loads would time out.
        server.gate = threading.Barrier(len(names), timeout=60)
        with ThreadPoolExecutor(len(names)) as pool:
            replies = list(pool.map(lambda name: load(stub, f"c-{name}", server.url("gate", name)), names))
    assert [r.success for r in replies] == [True] * len(names), [r.error_message for r in replies]
    registry = listed(stub)
    for name in names:
        info = registry[f"c-{name}"]
        assert info.sha256 == sha256(shared.adapters[name]) and list(info.ranks) == [0, 1]
    outputs = forward(stub, *[(PROMPT, f"c-{name}") for name in names[:4]])
    outputs += forward(stub, *[(PROMPT, f"c-{name}") for name in names[4:]])
    assert len({o.tobytes() for o in outputs}) == len(names), "each name serves its own weights"


def test_calls_for_the_same_name_are_serialised(shared, stub):
    with http_server(shared.root) as server:
        server.gate = threading.Barrier(1)
        server.delay_s = 0.3
        with ThreadPoolExecutor(2) as pool:
            uri = server.url("gate", "ad9")
            same = list(pool.map(lambda _: load(stub, "serial", uri), range(2)))
            assert server.concurrent_peak["ad9"] == 1, "two loads of one name never fetch at once"
            assert sorted(r.already_loaded for r in same) == [False, True]
            server.concurrent_peak.clear()
            list(pool.map(lambda name: load(stub, name, uri), ["other-a", "other-b"]))
            assert server.concurrent_peak["ad9"] == 2, "premise: loads of two names do overlap"
