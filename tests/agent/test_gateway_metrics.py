"""The per-adapter request metrics' bounded label set: at most `max_adapters` adapters have a
label of their own, the others count under `_other`, and an unloaded adapter frees its place.
Driven through the agent's own recorder (`DemandRecorder`), read back through the text format
and prometheus_client's parser, as a scraper reads it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_agent.adapter_metrics import BASE_LABEL, OTHER_LABEL, AdapterRequestMetrics
from node_agent.adapter_stats import DemandRecorder
from node_agent.backends.server_demand import adapter_counts


def requests_by_label(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "lorafleet_agent_adapter_requests"]
    return {s.labels["adapter"]: s.value for s in family.samples if s.name.endswith("_total")}


def one_request(recorder: DemandRecorder, adapter: str | None, tokens: int = 2) -> None:
    measure = recorder.request(adapter, prompt_tokens=3)
    for _ in range(tokens):
        measure.token()


def test_adapters_beyond_the_cap_count_as_other_until_one_is_unloaded():
    registry = CollectorRegistry()
    recorder = DemandRecorder(AdapterRequestMetrics(registry, max_adapters=2))
    for adapter in ("a", "b", "c", "d", None, "a"):
        one_request(recorder, adapter)
    assert requests_by_label(registry) == {"a": 2, "b": 1, OTHER_LABEL: 2, BASE_LABEL: 1}

    recorder.forget("a")  # unloaded: its series go, its place is free
    one_request(recorder, "c")
    assert requests_by_label(registry) == {"b": 1, "c": 1, OTHER_LABEL: 2, BASE_LABEL: 1}
    recorder.forget("d")  # counted under _other only: nothing of it to remove
    assert requests_by_label(registry)[OTHER_LABEL] == 2


def test_a_request_that_streams_nothing_takes_no_label():
    """Only a request whose adapter answered counts: a name no adapter has never becomes a label."""
    registry = CollectorRegistry()
    recorder = DemandRecorder(AdapterRequestMetrics(registry, max_adapters=1))
    recorder.request("no-such-adapter", prompt_tokens=4)
    one_request(recorder, "real")
    assert requests_by_label(registry) == {"real": 1}


def test_the_cap_must_not_be_negative():
    with pytest.raises(ValueError, match="at least 0"):
        AdapterRequestMetrics(CollectorRegistry(), max_adapters=-1)


def test_a_servers_other_requests_are_shared_among_the_adapters_it_names():
    """vLLM mode: a server's requests the agent's streams do not explain (`server_demand`)."""
    assert adapter_counts({}, 5, ["a"]) == {"a": 5}, "one adapter named: all of them are its"
    assert adapter_counts({"a": 2}, 2, ["a", "b"]) == {"a": 2}, "nothing left to explain"
    assert adapter_counts({"a": 1}, 4, ["a", "b"]) == {"a": 2, "b": 2}, "b has one at least, the rest shared"
    assert adapter_counts({}, 3, []) == {None: 3}, "none named: the base model's"
    assert adapter_counts({}, 0, ["a"]) == {}, "named but none counted (vLLM names running adapters as waiting too)"
