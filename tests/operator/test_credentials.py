"""Source credentials and the agent identity check, on the real control plane
with a real agent, the real operator, and real HTTP servers on loopback.

* hf:// sources from a local server speaking the Hub's resolve protocol
  (tests/agent/test_source_hub.py's `HubServer`), public and private: the token comes from a
  Secret opened to the fleet and goes to the hub only, never to its CDN;
* http(s) bearer and basic credentials (tests/agent/test_source_credentials.py's `Recorder`):
  sent to the source under the fleet's allowed prefix, never across a redirect, never to a host
  the fleet does not allow; a Secret not opened to the fleet (or the fleet's own token) refused
  without a word about it;
* no credential value in any status, Event, or the operator's and the agent's logs;
* a stand-in pod the fleet selects that is not an agent (a plain gRPC server recording every
  call's metadata) never receives the fleet's token, and is reported;
* a download held halfway (tests/agent/test_source_progress.py's `HalfThenHold`) shows its
  bytes in the Ready condition's message until it completes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet_common.registry import RegistryEntry
from lorafleet_dev.agents import AgentProcess, AgentSpec
from lorafleet_dev.synthetic import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_model
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.agent_values import Credentials
from lorafleet_operator.books import Listing
from lorafleet_operator.config import Settings
from lorafleet_operator.fleet import AgentPod
from lorafleet_operator.progress import describe
from lorafleet_operator.resources import FleetSpec
from lorafleet_operator.runtime import Runtime
from lorafleet_operator.unloads import unload_departed
from lorafleet_operator.view import FleetView
from tests.agent import test_source_credentials as http_sources
from tests.agent import test_source_hub as hub_sources
from tests.agent.helpers import running
from tests.agent.test_source_progress import HalfThenHold
from tests.kube.harness import ControlPlane
from tests.operator.agents import (
    BASE_MODEL,
    SHAPE,
    adapter_manifest,
    add_agent_pod,
    apply,
    make_adapter,
    status,
)
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.test_tenants import Workload, secret, workload
from tests.operator.token_agents import OPENED, TokenAgent, token_fleet, write_token

__all__ = ["workload"]  # the stand-in pod's fixture, used below


@dataclass
class Env:
    agent: AgentProcess
    token: str
    adapters: Path
    hub: hub_sources.HubServer
    private: http_sources.Recorder
    other: http_sources.Recorder


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One agent (tp=1) that requires a token and fetches hf:// from the local hub; the hub,
    its CDN, and the two http servers."""
    root = tmp_path_factory.mktemp("cred-agent")
    token, token_file = write_token(root)
    adapters = root / "adapters"
    adapters.mkdir()
    hub = hub_sources.HubServer()
    hub.repos["org/lora"] = hub_sources.Repo({hub_sources.COMMIT_A: make_adapter(root, "pub", seed=51)}, {"main": hub_sources.COMMIT_A})
    hub.repos["org/private"] = hub_sources.Repo(
        {hub_sources.COMMIT_A: make_adapter(root, "priv", seed=52)}, {"main": hub_sources.COMMIT_A}, private=True
    )
    make_adapter(root / "http", "ad", seed=53)
    private = http_sources.Recorder(root / "http", {f"Bearer {http_sources.TOKEN}", http_sources.BASIC})
    other = http_sources.Recorder(root / "http")
    private.target = other
    spec = AgentSpec(
        model_dir=write_model(root / "model", SHAPE),
        adapter_roots=(adapters,),
        base_model_name=BASE_MODEL,
        tp=1,
        dp=1,
        extra_args=(
            "--cache-dir",
            str(root / "cache"),
            "--hub-endpoint",
            hub.endpoint,
            "--auth-token-file",
            str(token_file),
            # a held download waits for the test, not for a minimum rate
            "--download-min-bytes-per-s",
            "0",
        ),
    )
    agent = AgentProcess("cred-agent", spec, root / "logs")
    with running(hub), running(hub.cdn), running(private), running(other):
        agent.start()
        try:
            agent.wait_ready()
            yield Env(agent, token, adapters, hub, private, other)
        finally:
            agent.stop()


def registry(env: Env, ns: str) -> set[str]:
    """This namespace's names in the agent's registry (asked with its token)."""
    return TokenAgent(env.agent, env.token).held(ns)


def remote(name: str, uri: str, secret_name: str = "", kind: str = "Bearer") -> dict[str, Any]:
    manifest = adapter_manifest(name, Path("/unused"))
    manifest["spec"]["source"]["uri"] = uri
    if secret_name:
        manifest["spec"]["source"]["credentials"] = {"type": kind, "secretRef": {"name": secret_name}}
    return manifest


def ready(cluster: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return dict((status(cluster, ns, name).get("conditions") or [{}])[0])


def assert_nowhere(cluster: ControlPlane, ns: str, op: OperatorProcess, env: Env, *values: str) -> None:
    """None of the values in any LoraAdapter or LoraFleet, any Event, or either log."""
    texts = {
        "objects": cluster.kubectl("get", "la,lfleet", "-n", ns, "-o", "json").stdout,
        "events": cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout,
        "operator log": op.log(),
        "agent log": env.agent.log_path.read_text(errors="replace"),
    }
    for value in values:
        for where, text in texts.items():
            assert value not in text, f"a credential appears in the {where}"


def test_hf_sources_with_and_without_a_token(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    env: Env,
    operator: OperatorProcess,
) -> None:
    """A public repository loads without a credential; a private one with the Hub token from a
    Secret opened to the fleet (sent to the hub, not its CDN); a repository of an organisation
    the fleet does not allow is not loaded."""
    ns = kube_namespace
    add_agent_pod(kube_cluster, ns, env.agent)
    token_fleet(kube_cluster, ns, env.token, ["hf://org/"])
    env.hub.seen.hub.clear()
    env.hub.seen.cdn.clear()
    apply(
        kube_cluster,
        ns,
        secret("hub-token", {"token": hub_sources.TOKEN.encode() + b"\n"}, OPENED),
        remote("public", "hf://org/lora"),
        remote("private", "hf://org/private", "hub-token"),
        remote("elsewhere", "hf://someone/lora", "hub-token"),
    )
    for name in ("public", "private"):
        wait_for(lambda n=name: status(kube_cluster, ns, n).get("phase") == "Ready", 90, f"{name} Ready", operator)
    wait_for(lambda: ready(kube_cluster, ns, "elsewhere").get("reason") == "SourceNotAllowed", 60, "elsewhere refused", operator)
    assert registry(env, ns) == {f"{ns}.public", f"{ns}.private"}
    private_asks = [auth for path, auth in env.hub.seen.hub if path.startswith("/org/private/")]
    assert private_asks and set(private_asks) == {f"Bearer {hub_sources.TOKEN}"}
    assert {auth for path, auth in env.hub.seen.hub if path.startswith("/org/lora/")} == {None}
    assert {auth for _, auth in env.hub.seen.cdn} == {None}, "never across the redirect to the CDN"
    assert not [p for p, _ in env.hub.seen.hub if p.startswith("/someone/")]
    assert_nowhere(kube_cluster, ns, operator, env, hub_sources.TOKEN, env.token)


def test_http_credentials_go_only_to_allowed_hosts_and_unopened_secrets_say_nothing(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    env: Env,
    operator: OperatorProcess,
) -> None:
    """Basic and bearer credentials reach the allowed source, never the host a redirect leads to
    nor a host the fleet does not allow. A missing Secret, one not opened to the fleet and one
    without the key are refused with one message; the fleet's own token is never a source
    credential."""
    ns = kube_namespace
    add_agent_pod(kube_cluster, ns, env.agent)
    token_fleet(kube_cluster, ns, env.token, [env.private.url("")])
    env.private.seen.clear()
    env.other.seen.clear()
    user, password = http_sources.USER.encode(), http_sources.PASSWORD.encode()
    apply(
        kube_cluster,
        ns,
        secret("src-basic", {"username": user, "password": password}, OPENED),
        secret("src-bearer", {"token": http_sources.TOKEN.encode()}, OPENED),
        secret("db", {"token": b"db-s3cret-value"}),
        secret("keyless", {"other": b"x"}, OPENED),
        remote("basic", env.private.url("files/ad"), "src-basic", "Basic"),
        remote("moved", env.private.url("moved/ad"), "src-bearer"),
        remote("outside", env.other.url("outside/ad"), "src-bearer"),
        *(remote(f"refused-{s}", env.private.url("files/ad"), s) for s in ("missing", "db", "keyless")),
        remote("own-token", env.private.url("files/ad"), "agent-token"),
    )
    for name in ("basic", "moved"):
        wait_for(lambda n=name: status(kube_cluster, ns, n).get("phase") == "Ready", 90, f"{name} Ready", operator)
    wait_for(lambda: ready(kube_cluster, ns, "outside").get("reason") == "SourceNotAllowed", 60, "outside refused", operator)
    # Nothing sent and no agent refused anything: Pending, the reason and message saying what
    # the Secret's owner does (before: Failed on every agent).
    refused = {
        "refused-missing": "SecretNotOpened",
        "refused-db": "SecretNotOpened",
        "refused-keyless": "SecretNotOpened",
        "own-token": "SourceCredentialRefused",
    }
    for name, reason in refused.items():
        wait_for(
            lambda n=name, r=reason: (status(kube_cluster, ns, n).get("phase"), ready(kube_cluster, ns, n).get("reason")) == ("Pending", r),
            60,
            f"{name} Pending {reason}",
            operator,
        )
    assert {auth for _, auth in env.private.seen} == {http_sources.BASIC, f"Bearer {http_sources.TOKEN}"}
    assert env.other.seen and {auth for _, auth in env.other.seen} == {None}, env.other.seen
    assert not [path for path, _ in env.other.seen if path.startswith("/outside/")], "a host the fleet does not allow"
    shown = {status(kube_cluster, ns, f"refused-{s}")["message"].replace(repr(s), "S") for s in ("missing", "db", "keyless")}
    assert len(shown) == 1, shown
    (text,) = shown
    for leak in ("not found", "404", "403", "forbidden", "lacks", "other", "exist"):
        assert leak not in text.lower(), (leak, text)
    assert "opened to lorafleet (label lorafleet.dev/allow-fleet" in text
    assert "own agent credentials" in status(kube_cluster, ns, "own-token")["message"]
    assert registry(env, ns) == {f"{ns}.basic", f"{ns}.moved"}
    # The Secret's owner adds the key: a drift check reads the Secret again and loads it.
    apply(kube_cluster, ns, secret("keyless", {"other": b"x", "token": http_sources.TOKEN.encode()}, OPENED))
    wait_for(
        lambda: status(kube_cluster, ns, "refused-keyless").get("phase") == "Ready",
        90,
        "refused-keyless Ready once its Secret holds the key",
        operator,
    )
    assert registry(env, ns) == {f"{ns}.basic", f"{ns}.moved", f"{ns}.refused-keyless"}
    assert_nowhere(
        kube_cluster,
        ns,
        operator,
        env,
        http_sources.TOKEN,
        http_sources.PASSWORD,
        http_sources.BASIC.split()[1],
        "db-s3cret-value",
        env.token,
    )


def test_the_token_goes_only_to_pods_that_prove_they_are_agents(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    env: Env,
    workload: Workload,
    operator: OperatorProcess,
) -> None:
    """The fleet selects the real agent and a stand-in pod with the same labels (a plain gRPC
    server that records every call's metadata). The stand-in is asked to prove it is an agent,
    fails, never receives the token, and is reported (its status entry, a NotAnAgent Event, the
    log); the agent proves it, receives the token and loads the adapter."""
    ns = kube_namespace
    add_agent_pod(kube_cluster, ns, env.agent)
    kube_cluster.create_agent_pod(ns, "impostor", workload.port, labels={"lorafleet.dev/fleet": "default"})
    token_fleet(kube_cluster, ns, env.token, [])
    apply(kube_cluster, ns, adapter_manifest("plain", make_adapter(env.adapters / ns, "plain")))
    wait_for(lambda: f"{ns}.plain" in registry(env, ns), 90, "the agent loaded it", operator)

    def impostor_entry() -> dict[str, Any]:
        return next(a for a in status(kube_cluster, ns, "plain").get("agents", []) if a["pod"] == "impostor")

    wait_for(
        lambda: "did not prove it is a lorafleet agent" in impostor_entry().get("message", ""),
        60,
        "the impostor reported in status",
        operator,
    )
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 3, 60, "drift checks", operator)
    with workload.lock:
        methods = [method for method, _ in workload.calls]
    assert methods and set(methods) == {"/lorafleet.v1.NodeAgent/ProveIdentity"}, methods
    assert set(workload.tokens()) == {""}, "the token never went to the stand-in"
    events = kube_cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=impostor")["items"]
    assert [e["reason"] for e in events] == ["NotAnAgent"], events
    assert "did not prove it is a lorafleet agent" in operator.log()
    assert status(kube_cluster, ns, "plain")["phase"] == "Degraded"
    assert_nowhere(kube_cluster, ns, operator, env, env.token)
    assert base64.b64encode(env.token.encode()).decode() not in json.dumps(events)


def test_an_unload_at_a_departed_pods_address_sends_the_token_only_after_a_new_proof(
    workload: Workload,
) -> None:
    """A deletion unloads also where an agent pod went away (``unloads.unload_departed``).
    Its address may be another pod's by now: here a plain gRPC server that records every call,
    at an endpoint where an agent had proved it holds the token. The unload first challenges
    it again (no token in the challenge); it fails, and the token is never sent. Before, the
    old proof let the UnloadAdapter call carry the token straight to it."""
    settings = Settings(call_deadline_s=5.0)
    rt = Runtime(settings, None, AgentClients(settings))
    endpoint, name, token = f"127.0.0.1:{workload.port}", "team.one", secrets.token_urlsafe(24)
    gone = AgentPod(name="agent-1", namespace="team", uid="u1", labels={}, ready=True, endpoint=endpoint, restarts=0)
    rt.agents.observe([gone])
    rt.agents.identities.prove(endpoint, token)  # the agent that was there proved it
    rt.books.registries[endpoint] = Listing(1.0, ("u1", 0), {name: RegistryEntry(name, "file:///a", "ab", False, (0,))})
    view = FleetView("team", (), {}, Credentials(token=token), "default", FleetSpec())

    asyncio.run(unload_departed(rt, view, name))

    with workload.lock:
        methods = [method for method, _ in workload.calls]
    assert methods == ["/lorafleet.v1.NodeAgent/ProveIdentity"], methods
    assert set(workload.tokens()) == {""}, "the token went to the pod at the reused address"


def test_a_long_download_shows_its_progress_in_the_ready_condition(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    env: Env,
    operator: OperatorProcess,
) -> None:
    """The source sends the config and half the weights, then holds the rest: meanwhile the
    Ready condition's message shows the agent's bytes of the declared total; once released the
    adapter is Ready and the message says no more about downloading."""
    ns = kube_namespace
    add_agent_pod(kube_cluster, ns, env.agent)
    adapter = env.private.root / "ad"
    config, weights = (adapter / ADAPTER_CONFIG).stat().st_size, (adapter / ADAPTER_WEIGHTS).stat().st_size
    with running(HalfThenHold(env.private.root)) as half:
        try:
            token_fleet(kube_cluster, ns, env.token, [half.url("")])
            apply(kube_cluster, ns, remote("slow", half.url("ad")))
            shown = f"cred-agent {describe(config + weights // 2, config + weights)}"
            wait_for(
                lambda: shown in ready(kube_cluster, ns, "slow").get("message", ""), 60, "the progress in the Ready condition", operator
            )
            assert ready(kube_cluster, ns, "slow")["message"].startswith("Loading: downloading the source")
        finally:
            half.release.set()
        wait_for(lambda: status(kube_cluster, ns, "slow").get("phase") == "Ready", 90, "slow Ready", operator)
    assert "downloading" not in ready(kube_cluster, ns, "slow").get("message", "")


def test_a_download_the_drift_check_started_shows_its_progress_too(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    env: Env,
    operator: OperatorProcess,
) -> None:
    """The adapter is created before its fleet has an agent (Pending: the handler loads
    nothing); the agent's pod then appears and the drift check places and loads it. That load
    shows its bytes in the Ready condition's message like a handler's (one path). Before: a
    load the drift check started showed none."""
    ns = kube_namespace
    adapter = env.private.root / "ad"
    config, weights = (adapter / ADAPTER_CONFIG).stat().st_size, (adapter / ADAPTER_WEIGHTS).stat().st_size
    with running(HalfThenHold(env.private.root)) as half:
        try:
            token_fleet(kube_cluster, ns, env.token, [half.url("")])
            apply(kube_cluster, ns, remote("late", half.url("ad")))
            wait_for(lambda: status(kube_cluster, ns, "late").get("phase") == "Pending", 60, "late Pending without agents", operator)
            add_agent_pod(kube_cluster, ns, env.agent)
            shown = f"cred-agent {describe(config + weights // 2, config + weights)}"
            wait_for(
                lambda: shown in ready(kube_cluster, ns, "late").get("message", ""),
                60,
                "the drift check's load progress in the Ready condition",
                operator,
            )
            assert "drift: loaded" not in operator.log()  # the load is still running
        finally:
            half.release.set()
        wait_for(lambda: status(kube_cluster, ns, "late").get("phase") == "Ready", 90, "late Ready", operator)
    assert f"drift: loaded {ns}/late on cred-agent: Loaded" in operator.log()
    assert "downloading" not in ready(kube_cluster, ns, "late").get("message", "")
