"""The main job on the embedded local default (``bash scripts/demo.sh``).

One command brings up everything on this machine and tears it down again:

1. a real control plane (etcd, kube-apiserver, kube-controller-manager;
   :mod:`lorafleet_dev.controlplane`) with the lorafleet CRDs (the chart's ``crds/``);
2. a tiny random Llama model and two PEFT adapters, generated under a temporary directory;
3. two node agents (``lorafleet-agent serve``, tp=2 and dp=2 on the CPU) and their Pod objects;
4. the operator (``lorafleet-operator``, as a separate process, as in a cluster);
5. ``deploy/examples/`` applied — the adapters' ``file:///var/lib/lorafleet/adapters/...`` paths
   (the chart's adapter root) rewritten to the demo's adapter directory;
6. waits until every LoraAdapter is Ready, runs ``Generate`` with an adapter on each agent, and
   prints the ``kubectl get la`` table.

Everything stops on exit, on Ctrl-C and on SIGTERM. ``--keep-running`` leaves it up until Ctrl-C
(with a KUBECONFIG to try ``kubectl`` against).

The repository (examples, CRDs, the kube build script) is ``--repo``, by default the checkout
holding the current directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc

from lorafleet.v1 import agent_pb2, agent_pb2_grpc
from lorafleet_dev.agents import AgentProcess, AgentSpec, start_agents
from lorafleet_dev.checkout import Checkout, CheckoutError
from lorafleet_dev.controlplane import ControlPlane, find_bin_dir
from lorafleet_dev.processes import free_port
from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model

log = logging.getLogger("lorafleet.demo")

#: The adapter root the examples (and the chart) use; the demo substitutes its own.
EXAMPLE_ADAPTER_ROOT = "/var/lib/lorafleet/adapters"
BASE_MODEL = "tiny-llama"
NAMESPACE = "default"
PROMPT = [1, 5, 9, 42, 7]


def _raise_on_sigterm() -> None:
    """SIGTERM cleans up like Ctrl-C (the finally blocks stop every process)."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))


def write_files(checkout: Checkout, root: Path) -> tuple[Path, Path]:
    """The tiny model and one adapter per example LoraAdapter; returns (model, adapter root)."""
    shape = SyntheticModel()
    model = write_model(root / "model", shape)
    adapters = root / "adapters"
    for seed, manifest in enumerate(sorted(checkout.examples.glob("loraadapter-*.yaml")), start=1):
        for line in manifest.read_text().splitlines():
            if line.strip().startswith("uri: file://"):
                name = line.strip().rsplit("/", 1)[-1]
                write_adapter(adapters / name, shape, rank=8 if seed == 1 else 4, seed=seed)
    return model, adapters


def example_manifests(checkout: Checkout, adapter_root: Path) -> str:
    """deploy/examples/*.yaml as one stream, file:// paths pointed at the demo's adapters."""
    docs = [p.read_text().replace(EXAMPLE_ADAPTER_ROOT, str(adapter_root)) for p in sorted(checkout.examples.glob("*.yaml"))]
    return "\n---\n".join(docs)


@contextmanager
def running_operator(cluster: ControlPlane, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``lorafleet-operator`` for the demo namespace, stopped with SIGTERM on exit."""
    env = {
        **cluster.tool_env(),
        "LORAFLEET_WATCH_NAMESPACES": NAMESPACE,
        "LORAFLEET_LEASE_NAMESPACE": NAMESPACE,
        "POD_NAME": "demo-operator",
        "LORAFLEET_DRIFT_INTERVAL_SECONDS": "5",
        "LORAFLEET_METRICS_PORT": str(free_port()),
    }
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(["lorafleet-operator"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(cluster: ControlPlane, timeout_s: float, operator_log: Path) -> None:
    """Until every LoraAdapter reports phase Ready (the operator's log tail on a timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        items = cluster.kubectl_json("get", "la", "-n", NAMESPACE)["items"]
        phases = {i["metadata"]["name"]: (i.get("status") or {}).get("phase") for i in items}
        if items and all(p == "Ready" for p in phases.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"adapters not Ready after {timeout_s:.0f}s: {phases}\n{operator_log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


def generate(agent: AgentProcess, adapter: str) -> list[int]:
    """Greedy tokens from one agent, with an adapter ("" for the base model)."""
    with grpc.insecure_channel(agent.endpoint) as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        request = agent_pb2.GenerateRequest(token_ids=PROMPT, adapter=adapter, max_new_tokens=8)
        return [reply.token_id for reply in stub.Generate(request, timeout=60)]


def run(checkout: Checkout, work: Path, keep_running: bool) -> int:
    """Bring everything up under ``work``, show it working, and stop it all again."""
    with ExitStack() as stack:
        log.info("starting the control plane (etcd, kube-apiserver, kube-controller-manager)")
        cluster = ControlPlane.start(find_bin_dir(checkout))
        stack.callback(cluster.stop)
        cluster.kubectl("apply", "--server-side", "-f", str(checkout.crds))
        cluster.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", "crd/loraadapters.lorafleet.dev", "crd/lorafleets.lorafleet.dev"
        )

        model, adapters = write_files(checkout, work)
        log.info("wrote a tiny random model and adapters %s under %s", sorted(p.name for p in adapters.iterdir()), work)
        spec = AgentSpec(model_dir=model, adapter_roots=(adapters,), base_model_name=BASE_MODEL)
        log.info("starting two node agents (tp=2, dp=2 on the CPU)")
        agents = start_agents(["lorafleet-agent-0", "lorafleet-agent-1"], spec, work / "logs")
        for agent in agents:
            stack.callback(agent.stop)
            cluster.create_agent_pod(NAMESPACE, agent.name, agent.port)

        operator_log = work / "logs" / "operator.log"
        log.info("starting the operator (log: %s)", operator_log)
        stack.enter_context(running_operator(cluster, operator_log))
        log.info("applying deploy/examples/ (adapter root %s -> %s)", EXAMPLE_ADAPTER_ROOT, adapters)
        started = time.monotonic()
        log.info(cluster.apply(example_manifests(checkout, adapters), NAMESPACE).rstrip())
        wait_ready(cluster, 300, operator_log)
        log.info("every LoraAdapter Ready after %.1fs", time.monotonic() - started)

        base = generate(agents[0], "")
        log.info("Generate, base model          on %s: %s", agents[0].name, base)
        for agent in agents:
            tokens = generate(agent, f"{NAMESPACE}.support-bot")
            log.info("Generate, adapter support-bot on %s: %s", agent.name, tokens)
        log.info("\n$ kubectl get la\n%s", cluster.kubectl("get", "la", "-n", NAMESPACE).stdout)
        if keep_running:
            log.info("running; try: KUBECONFIG=%s kubectl get la,lfleet -o wide   (Ctrl-C stops)", cluster.kubeconfig)
            while True:
                time.sleep(3600)
    log.info("stopped everything")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lorafleet_dev.demo [--repo PATH] [--keep-running]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lorafleet_dev.demo", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repo", type=Path, default=None, help="the lorafleet checkout (default: the one holding the current directory)")
    parser.add_argument("--keep-running", action="store_true", help="leave everything up until Ctrl-C")
    args = parser.parse_args(argv)
    try:
        checkout = Checkout.at(args.repo) if args.repo else Checkout.find(Path.cwd())
    except CheckoutError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("lorafleet_dev").setLevel(logging.WARNING)
    _raise_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="lorafleet-demo-"))
    try:
        return run(checkout, work, args.keep_running)
    except KeyboardInterrupt:
        log.info("interrupted; stopped everything")
        return 130
    finally:
        if not os.environ.get("LORAFLEET_KEEP_DEMO_DIR"):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
