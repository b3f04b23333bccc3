"""Standby adapters through the HTTP API (the session's agent, tp=2 dp=2): listed by /v1/models,
and the first completion or chat completion that names one loads it and is answered; the serve
flags of on-demand loads."""

from __future__ import annotations

import pytest

from node_agent.cli import UsageError, agent_config, build_parser
from node_agent.residency import OnDemandSettings
from tests.agent.helpers import make_adapter
from tests.http.conftest import grpc_generate

PROMPT = "w1 w2 w3 w40 w41"


def standby(served, name: str, seed: int) -> None:
    path = make_adapter(served.agent.config.sources.adapter_roots[0] / name, seed=seed)
    assert served.agent.load(name, path.as_uri(), standby=True).ok
    assert served.agent.registry.get(name).standby


def test_the_first_completion_naming_a_standby_adapter_loads_it(served, client):
    standby(served, "sb-completion", seed=500)
    try:
        listed = {a.name: a for a in served.agent.list_adapters()}
        assert listed["sb-completion"].standby and listed["sb-completion"].ranks == ()
        assert "sb-completion" in {m.id for m in client.models.list().data}, "every adapter the agent can serve is listed"
        completion = client.completions.create(model="sb-completion", prompt=PROMPT, max_tokens=6, temperature=0)
        assert completion.choices[0].finish_reason == "length"
        listed = {a.name: a for a in served.agent.list_adapters()}
        assert not listed["sb-completion"].standby and listed["sb-completion"].ranks == (0, 1)
        tokens = grpc_generate(served, prompt=PROMPT, adapter="sb-completion", max_new_tokens=6)
        assert completion.choices[0].text == "".join(r.text for r in tokens), "the loaded adapter's own tokens"
    finally:
        served.agent.unload("sb-completion")


def test_the_first_chat_completion_naming_a_standby_adapter_loads_it(served, client):
    standby(served, "sb-chat", seed=501)
    try:
        chat = client.chat.completions.create(model="sb-chat", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=4)
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens == 4
        assert not served.agent.registry.get("sb-chat").standby
    finally:
        served.agent.unload("sb-chat")


def test_the_on_demand_flags_become_the_agent_settings_and_are_checked():
    base = ["serve", "--model", "m"]
    assert agent_config(build_parser().parse_args(base)).on_demand == OnDemandSettings()
    flags = ["--max-concurrent-adapter-loads", "3", "--adapter-load-deadline-s", "7.5"]
    assert agent_config(build_parser().parse_args(base + flags)).on_demand == OnDemandSettings(3, 7.5)
    for flag, phrase in (("--max-concurrent-adapter-loads", "at least 1"), ("--adapter-load-deadline-s", "positive")):
        with pytest.raises(UsageError, match=f"{flag} must be {phrase}"):
            agent_config(build_parser().parse_args([*base, flag, "0"]))
