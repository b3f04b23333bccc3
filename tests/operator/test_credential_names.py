"""Hostile names for a LoraAdapter's credential Secret never wedge its fleet: on the real control
plane, with a real agent and the real operator.

Six hostile ways to name the Secret, each a clear refusal of that one adapter:

1. percent-encoded (``creds-b%2Fbob-src-token``): the CRD refuses it at ``kubectl apply`` (a
   DNS-1123 subdomain); one stored before the CRD said so is Pending ``SourceCredentialRefused``
   naming it, never asked of the API server (whose 400 was once retried forever and failed
   the fleet's drift check at every interval);
2. the fleet's own agent token Secret: Pending ``SourceCredentialRefused``;
3. a ``namespace`` field inside ``secretRef``: the CRD refuses the unknown field (the Secret is
   always the adapter's namespace's);
4. a missing Secret: Pending ``SecretNotOpened``;
5. a Secret not opened to the fleet: Pending ``SecretNotOpened``, the same message;
6. a name with uppercase and a slash, or longer than 253 characters: the CRD refuses it.

Meanwhile the fleet's other adapters are placed and served: the refused ones take no room
(the agent has room for two, and they were created first), and one unloaded by hand is put
back by the drift check; no drift check fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess
from tests.kube.harness import CHECKOUT, ControlPlane
from tests.operator.agents import adapter_manifest, add_agent_pod, agent_spec, apply, make_adapter, serving, status
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.test_tenants import secret
from tests.operator.token_agents import OPENED, TokenAgent, token_fleet, write_token

SOURCE = "http://127.0.0.1:9/never/ad"
ENCODED = "creds-b%2Fbob-src-token"
#: The credential name's pattern in the LoraAdapter CRD (made lax for a while to store an object
#: "from before" it).
NAME_PATTERN = (
    "/spec/versions/0/schema/openAPIV3Schema"
    + "".join(f"/properties/{field}" for field in ("spec", "source", "credentials", "secretRef", "name"))
    + "/pattern"
)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenAgent]:
    """One agent (tp=1) with room for two adapters, requiring a token."""
    root = tmp_path_factory.mktemp("names-agent")
    token, token_file = write_token(root)
    extra = ("--cache-dir", str(root / "cache"), "--auth-token-file", str(token_file))
    spec, _ = agent_spec(root, tp=1, dp=1, max_loaded_loras=2, extra_args=extra)
    process = AgentProcess("names-agent", spec, root / "logs")
    with serving([process]):
        yield TokenAgent(process, token)


def credentialed(name: str, secret_ref: dict[str, Any]) -> dict[str, Any]:
    manifest = adapter_manifest(name, Path("/unused"))
    manifest["spec"]["source"] = {"uri": SOURCE, "credentials": {"type": "Bearer", "secretRef": secret_ref}}
    return manifest


def refused_at_apply(cluster: ControlPlane, ns: str, manifest: dict[str, Any]) -> str:
    """kubectl apply's error for this manifest ("" when it was accepted)."""
    done = cluster.kubectl("apply", "--validate=strict", "-n", ns, "-f", "-", input=json.dumps(manifest), check=False)
    return "" if done.returncode == 0 else done.stderr


def store_before_the_pattern(cluster: ControlPlane, ns: str, manifest: dict[str, Any]) -> None:
    """Store an adapter whose Secret name the CRD's pattern refuses, as one stored before the
    CRD had it: the pattern made lax, the object applied, the CRD applied again."""
    patch = json.dumps([{"op": "add", "path": NAME_PATTERN, "value": "^.+$"}])
    cluster.kubectl("patch", "crd", "loraadapters.lorafleet.dev", "--type=json", "-p", patch)
    try:
        wait_for(lambda: not refused_at_apply(cluster, ns, manifest), 30, "the object stored without the pattern")
    finally:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHECKOUT.crds))


def pending(cluster: ControlPlane, ns: str, name: str) -> tuple[str, str, str]:
    """The adapter's phase, and its Ready condition's reason and message."""
    current = status(cluster, ns, name)
    ready = (current.get("conditions") or [{}])[0]
    return current.get("phase", ""), ready.get("reason", ""), ready.get("message", "")


def test_hostile_credential_names_are_refused_one_by_one_and_the_fleet_goes_on(
    kube_cluster: ControlPlane,
    kube_namespace: str,
    lorafleet_crds: tuple[str, ...],
    agent: TokenAgent,
    operator: OperatorProcess,
) -> None:
    """Each hostile name is refused at apply or leaves its adapter Pending with a reason naming
    the Secret (never Loading, never NoRoom); the fleet's two other adapters load in the room
    the refused ones do not take, and one unloaded by hand is put back by the drift check."""
    ns = kube_namespace
    add_agent_pod(kube_cluster, ns, agent.process)
    token_fleet(
        kube_cluster,
        ns,
        agent.token,
        ["http://127.0.0.1:9/"],
        secret("src-token", {"token": b"source-s3cret"}, OPENED),
        secret("closed", {"token": b"closed-s3cret"}),
    )
    store_before_the_pattern(kube_cluster, ns, credentialed("encoded-stored", {"name": ENCODED}))
    apply(
        kube_cluster,
        ns,
        credentialed("own-token", {"name": "agent-token"}),
        credentialed("missing", {"name": "src-missing"}),
        credentialed("closed", {"name": "closed"}),
    )
    expected = {
        "encoded-stored": ("SourceCredentialRefused", f"Secret name {ENCODED!r} is not a Kubernetes object name"),
        "own-token": ("SourceCredentialRefused", "own agent credentials"),
        "missing": ("SecretNotOpened", "may not use Secret 'src-missing'"),
        "closed": ("SecretNotOpened", "may not use Secret 'closed'"),
    }

    def all_pending() -> bool:
        return all(pending(kube_cluster, ns, n)[:2] == ("Pending", reason) for n, (reason, _) in expected.items())

    wait_for(all_pending, 60, "every refused adapter Pending with its reason", operator)

    # Created after the refused ones, on an agent with room for two: they take no room.
    adapters = agent.process.spec.adapter_roots[0] / ns
    apply(kube_cluster, ns, *(adapter_manifest(n, make_adapter(adapters, n)) for n in ("served-a", "served-b")))
    for name in ("served-a", "served-b"):
        wait_for(lambda n=name: status(kube_cluster, ns, n).get("phase") == "Ready", 90, f"{name} Ready", operator)

    # Refused by the CRD at apply, each with its reason; none of them stored.
    hostile = {
        "encoded": ({"name": ENCODED}, "secretRef.name"),
        "namespace-field": (
            {"name": "src-token", "namespace": "kube-system"},
            'unknown field "spec.source.credentials.secretRef.namespace"',
        ),
        "upper-slash": ({"name": "Creds/Bob"}, "secretRef.name"),
        "too-long": ({"name": "a" * 254}, "secretRef.name"),
    }
    for name, (ref, words) in hostile.items():
        wait_for(lambda n=name, r=ref: refused_at_apply(kube_cluster, ns, credentialed(n, r)), 30, f"{name} refused at apply", operator)
        assert words in refused_at_apply(kube_cluster, ns, credentialed(name, ref)), name
    stored = {item["metadata"]["name"] for item in kube_cluster.kubectl_json("get", "la", "-n", ns)["items"]}
    assert stored == {*expected, "served-a", "served-b"}

    # The drift check repairs the fleet's other adapters meanwhile.
    agent.unload(f"{ns}.served-a")
    wait_for(lambda: f"{ns}.served-a" in agent.held(ns), 60, "served-a put back by the drift check", operator)
    checks = operator.drift_checks()
    wait_for(lambda: operator.drift_checks() >= checks + 3, 60, "drift checks", operator)

    assert agent.held(ns) == {f"{ns}.served-a", f"{ns}.served-b"}
    for name, (reason, words) in expected.items():
        phase, shown, message = pending(kube_cluster, ns, name)
        assert (phase, shown) == ("Pending", reason), (name, phase, shown, message)
        assert words in message, (name, message)
    failed = [line for line in operator.log().splitlines() if "drift check of lorafleet" in line and " failed" in line]
    assert not failed, failed[:3]
    assert "source-s3cret" not in operator.log() and "closed-s3cret" not in operator.log()
