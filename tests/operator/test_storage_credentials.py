"""s3:// and oci:// sources through the operator with what the fleet's Secrets hold, the revision
in status, and the hostile cases whose refusal the operator or the status carries: on the real
control plane, with a real agent reading a real S3 store (versitygw) and a real registry that
takes only its token service's tokens (distribution's ``auth: token``, artifacts pushed by the
real ``oras``).

The agent has no keys of its own: the S3 keys come from a Secret opened to the fleet (type
``S3``), the registry login from an opened ``kubernetes.io/dockerconfigjson`` Secret (type
``DockerConfigJson``), both sent with the load alone (never in a status, an Event or a log).
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lorafleet_dev.agents import AgentProcess
from lorafleet_dev.controlplane import KubectlError
from lorafleet_dev.storage_servers import (
    CONFIG_MEDIA_TYPE,
    RegistryServer,
    S3Keys,
    S3Server,
    TokenService,
    start_registry,
    start_s3_server,
)
from lorafleet_dev.synthetic import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lorafleet_operator.registry_credentials import NoRegistryLogin, registry_login
from tests.kube.harness import ControlPlane
from tests.operator.agents import adapter_manifest, add_agent_pod, apply, make_adapter, status
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.test_credentials import assert_nowhere  # reads the agent's log as `.agent`
from tests.operator.test_storage_sources import BUCKET, storage_agent_spec
from tests.operator.test_tenants import secret
from tests.operator.token_agents import OPENED, TokenAgent, token_fleet, write_token

KEYS = S3Keys("LORAFLEETSECRETKEY", "s3-secret-from-the-fleets-secret")
LOGIN = ("puller", "registry-password-from-a-secret")
MAX_CONFIG_BYTES = 1 << 20  # the agents' cap on adapter_config.json


@dataclass(frozen=True)
class Stores:
    """The S3 store, the token-protected registry, and the agent (with no keys) that reads them."""

    s3: S3Server
    oci: RegistryServer
    token_agent: TokenAgent
    work: Path

    @property
    def agent(self) -> AgentProcess:
        """The agent's process (what `assert_nowhere` reads the log of)."""
        return self.token_agent.process


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    root = tmp_path_factory.mktemp("storage-credentials")
    token, token_file = write_token(root)
    s3 = start_s3_server(root / "s3", KEYS)
    tokens = TokenService(*LOGIN)
    oci = start_registry(root / "registry", tokens, LOGIN)
    agent = None
    try:
        s3.create_bucket(BUCKET)
        # No keys of its own: what it reads with comes from the fleet's Secrets.
        spec = storage_agent_spec(root, s3, oci, 1, "--auth-token-file", str(token_file), "--allow-source", tokens.realm)
        agent = AgentProcess("storage-cred-agent", spec, root / "logs")
        agent.start().wait_ready()
        yield Stores(s3, oci, TokenAgent(agent, token), root)
    finally:
        if agent is not None:
            agent.stop()
        oci.stop()
        tokens.stop()
        s3.stop()


def fleet_with_secrets(cluster: ControlPlane, ns: str, stores: Stores) -> None:
    """The default fleet (the agent's token, the store's and the registry's prefixes), the S3
    keys and the registry login opened to it, and the same keys in a Secret not opened."""
    keys = {"AWS_ACCESS_KEY_ID": KEYS.access_key_id.encode(), "AWS_SECRET_ACCESS_KEY": KEYS.secret_access_key.encode()}
    auth = base64.b64encode(":".join(LOGIN).encode()).decode()
    docker_config = json.dumps({"auths": {f"http://{stores.oci.address}": {"auth": auth}}}).encode()
    pull = secret("pull", {".dockerconfigjson": docker_config}, OPENED) | {"type": "kubernetes.io/dockerconfigjson"}
    allow = [f"s3://{BUCKET}/team", f"oci://{stores.oci.address}/team"]
    token_fleet(cluster, ns, stores.token_agent.token, allow, secret("s3-keys", keys, OPENED), secret("s3-keys-closed", keys), pull)


def source(name: str, uri: str, kind: str = "", secret_name: str = "") -> dict[str, Any]:
    manifest = adapter_manifest(name, Path("/unused"))
    manifest["spec"]["source"] = {"uri": uri}
    if secret_name:
        manifest["spec"]["source"]["credentials"] = {"type": kind, "secretRef": {"name": secret_name}}
    return manifest


def settled(cluster: ControlPlane, ns: str, wanted: dict[str, str], operator: OperatorProcess) -> dict[str, dict[str, Any]]:
    """Wait until every named adapter is in its wanted phase; their statuses."""
    wait_for(lambda: all(status(cluster, ns, n).get("phase") == p for n, p in wanted.items()), 120, f"phases {wanted}", operator)
    return {name: status(cluster, ns, name) for name in wanted}


@pytest.fixture
def fleet(kube_cluster: ControlPlane, kube_namespace: str, lorafleet_crds: tuple[str, ...], stores: Stores) -> str:
    """The test's namespace with the agent's pod and the fleet with its Secrets
    (`fleet_with_secrets`)."""
    add_agent_pod(kube_cluster, kube_namespace, stores.agent)
    fleet_with_secrets(kube_cluster, kube_namespace, stores)
    return kube_namespace


def test_keys_and_registry_logins_come_from_opened_secrets_and_the_revision_is_held(
    kube_cluster: ControlPlane, fleet: str, stores: Stores, operator: OperatorProcess
) -> None:
    ns, oci = fleet, stores.oci.address
    etags = stores.s3.put_adapter(BUCKET, f"team/{ns}/a", make_adapter(stores.work / ns, "a", seed=61))
    digest = stores.oci.push_adapter(f"team/{ns}-lora", "v1", make_adapter(stores.work / ns, "b", seed=62))
    apply(
        kube_cluster,
        ns,
        source("from-s3", f"s3://{BUCKET}/team/{ns}/a", "S3", "s3-keys"),
        source("from-oci", f"oci://{oci}/team/{ns}-lora:v1", "DockerConfigJson", "pull"),
        source("closed", f"s3://{BUCKET}/team/{ns}/a", "S3", "s3-keys-closed"),
        source("no-keys", f"s3://{BUCKET}/team/{ns}/a"),
        source("no-login", f"oci://{oci}/team/{ns}-lora:v1"),
        source("wrong-type", f"s3://{BUCKET}/team/{ns}/a", "DockerConfigJson", "pull"),
    )
    st = settled(
        kube_cluster,
        ns,
        {"from-s3": "Ready", "from-oci": "Ready", "closed": "Pending", "no-keys": "Failed", "no-login": "Failed", "wrong-type": "Pending"},
        operator,
    )
    revision = f"{ADAPTER_CONFIG} etag {etags[ADAPTER_CONFIG]}; {ADAPTER_WEIGHTS} etag {etags[ADAPTER_WEIGHTS]}"
    assert st["from-s3"]["source"] == {"uri": f"s3://{BUCKET}/team/{ns}/a", "revision": revision}, st["from-s3"]
    assert st["from-oci"]["source"] == {"uri": f"oci://{oci}/team/{ns}-lora:v1", "revision": digest}, st["from-oci"]
    assert st["closed"]["conditions"][0]["reason"] == "SecretNotOpened", st["closed"]
    assert st["wrong-type"]["conditions"][0]["reason"] == "SourceCredentialRefused", st["wrong-type"]
    assert "403" in st["no-keys"]["message"] and "401" in st["no-login"]["message"], (st["no-keys"], st["no-login"])
    assert stores.token_agent.held(ns) == {f"{ns}.from-s3", f"{ns}.from-oci"}

    # The tag and the objects move; a load of the same URIs (the drift check's repair of an
    # agent that lost them) must find what status recorded, and is refused.
    moved = stores.oci.push_adapter(f"team/{ns}-lora", "v1", make_adapter(stores.work / ns, "c", seed=63))
    stores.s3.put_adapter(BUCKET, f"team/{ns}/a", make_adapter(stores.work / ns, "d", seed=64))
    stores.token_agent.unload(f"{ns}.from-s3")
    stores.token_agent.unload(f"{ns}.from-oci")
    st = settled(kube_cluster, ns, {"from-s3": "Failed", "from-oci": "Failed"}, operator)
    assert "changed since it was first resolved" in st["from-s3"]["message"], st["from-s3"]
    assert f"names {moved} now, not {digest}" in st["from-oci"]["message"], st["from-oci"]
    assert st["from-oci"]["source"]["revision"] == digest, st["from-oci"]
    assert stores.token_agent.held(ns) == set()
    assert_nowhere(
        kube_cluster, ns, operator, stores, KEYS.secret_access_key, LOGIN[1], base64.b64encode(":".join(LOGIN).encode()).decode()
    )


def test_hostile_storage_sources_are_refused_with_nothing_loaded(
    kube_cluster: ControlPlane, fleet: str, stores: Stores, operator: OperatorProcess
) -> None:
    ns, oci = fleet, stores.oci.address
    adapter = make_adapter(stores.work / ns, "h", seed=71)
    stores.s3.put_object(BUCKET, f"team/{ns}/big/{ADAPTER_CONFIG}", b" " * (MAX_CONFIG_BYTES + 1))
    stores.s3.put_object(BUCKET, f"team/{ns}/big/{ADAPTER_WEIGHTS}", (adapter / ADAPTER_WEIGHTS).read_bytes())
    shutil.copy(adapter / ADAPTER_WEIGHTS, adapter / "adapter_model.bin")
    pickled = {ADAPTER_CONFIG: CONFIG_MEDIA_TYPE, "adapter_model.bin": "application/octet-stream"}
    stores.oci.push_artifact(f"team/{ns}-pickled", "v1", adapter, pickled)
    stores.oci.push_adapter(f"team/{ns}-lora", "v1", make_adapter(stores.work / ns, "ok", seed=72))
    keys, pull = ("S3", "s3-keys"), ("DockerConfigJson", "pull")
    apply(
        kube_cluster,
        ns,
        # A raw '..' is refused by the API server (the CRD); encoded, it reaches the operator.
        source("key-traversal", f"s3://{BUCKET}/team/{ns}/%2e%2e/%2E%2E/private", *keys),
        source("repo-traversal", f"oci://{oci}/team/%2e%2e/private/lora:v1", *pull),
        source("endpoint", f"s3://169.254.169.254:80/team/{ns}/x", *keys),
        source("wrong-digest", f"oci://{oci}/team/{ns}-lora@sha256:{'0' * 64}", *pull),
        source("over-cap", f"s3://{BUCKET}/team/{ns}/big", *keys),
        source("pickled", f"oci://{oci}/team/{ns}-pickled:v1", *pull),
    )
    st = settled(
        kube_cluster,
        ns,
        {
            "key-traversal": "Pending",
            "repo-traversal": "Pending",
            "endpoint": "Pending",
            "wrong-digest": "Failed",
            "over-cap": "Failed",
            "pickled": "Failed",
        },
        operator,
    )
    with pytest.raises(KubectlError, match=r"must not contain '\.\.' path segments"):
        apply(kube_cluster, ns, source("raw-traversal", f"s3://{BUCKET}/team/{ns}/../../private", *keys))
    for name in ("key-traversal", "repo-traversal", "endpoint"):
        assert st[name]["conditions"][0]["reason"] == "SourceNotAllowed", st[name]
    assert "'..' (traversal)" in st["key-traversal"]["message"] and "'..' (traversal)" in st["repo-traversal"]["message"]
    assert "the S3 endpoint is the fleet owner's" in st["endpoint"]["message"], st["endpoint"]
    assert "does not hold" in st["wrong-digest"]["message"] or "not found" in st["wrong-digest"]["message"], st["wrong-digest"]
    assert "cap" in st["over-cap"]["message"], st["over-cap"]
    assert "pickle" in st["pickled"]["message"], st["pickled"]
    assert all("source" not in s for s in st.values()), st
    assert stores.token_agent.held(ns) == set()


def docker_config(auths: object) -> bytes:
    return json.dumps({"auths": auths}).encode()


AUTH = base64.b64encode(b"robot:pw").decode()


@pytest.mark.parametrize(
    "config, registry, login",
    [
        (docker_config({"reg.example:5000": {"auth": AUTH}}), "reg.example:5000", ("robot", "pw")),
        (docker_config({"https://REG.example:5000/v2/": {"username": "robot", "password": "pw"}}), "reg.example:5000", ("robot", "pw")),
        (docker_config({"https://index.docker.io/v1/": {"auth": AUTH}}), "registry-1.docker.io", ("robot", "pw")),
    ],
)
def test_a_docker_config_gives_the_login_of_the_sources_registry(config: bytes, registry: str, login: tuple[str, str]) -> None:
    assert registry_login(config, registry) == login


@pytest.mark.parametrize(
    "config, problem",
    [
        (b"not json", "is not a docker config"),
        (docker_config({"other.example": {"auth": AUTH}}), "no entry for registry reg.example"),
        (docker_config({"reg.example": {"identitytoken": "itok-9f3a"}}), "only an identity token"),
        (docker_config({"reg.example": {"auth": "bm8tY29sb24="}}), "not base64 of user:password"),
    ],
)
def test_a_docker_config_without_a_usable_login_is_refused_without_its_values(config: bytes, problem: str) -> None:
    with pytest.raises(NoRegistryLogin, match=problem) as refused:
        registry_login(config, "reg.example")
    assert "itok-9f3a" not in str(refused.value) and AUTH not in str(refused.value)
