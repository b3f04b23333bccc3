"""``lorafleet-operator``: leader election, metrics, then kopf (standalone, namespaced).

Only the replica holding the Lease runs kopf at all, so only one ever acts; a replica that
loses the Lease stops kopf and exits non-zero (its pod restarts and waits as a follower). kopf
runs ``--standalone`` (no peering CRDs) and only in the watched namespaces, matching the
chart's namespaced RBAC. Configuration comes from the environment (see :mod:`config`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import os
import sys

import kopf
from prometheus_client import start_http_server

from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.config import Settings
from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.leader import LeaderElector
from lorafleet_operator.runtime import Runtime

log = logging.getLogger("lorafleet.operator")

#: Importing these registers their kopf handlers (in kopf's default registry).
HANDLER_MODULES = ("lorafleet_operator.handlers", "lorafleet_operator.drift")


def configure_logging(level: str) -> None:
    """Our loggers at ``level``; kopf's own chatter (a line per handler) only when debugging."""
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":
        for name in ("kopf", "kopf.objects", "kopf.activities", "kopf.reactor"):
            logging.getLogger(name).setLevel(logging.WARNING)


async def run(settings: Settings, kubeconfig: str | None = None) -> int:
    """Elect, then operate until stopped (signal) or leadership is lost; returns an exit code."""
    for module in HANDLER_MODULES:
        importlib.import_module(module)
    api = make_api_client(kubeconfig)
    elector = LeaderElector(api, settings)
    await elector.acquire()
    stop = asyncio.Event()
    holding = asyncio.create_task(elector.hold(stop.set))
    runtime = Runtime(settings=settings, kube=Kube(api), agents=AgentClients(settings))
    try:
        await kopf.operator(standalone=True, clusterwide=False,
                            namespaces=list(settings.namespaces),
                            memo=kopf.Memo(runtime=runtime), stop_flag=stop)
    finally:
        holding.cancel()
        await runtime.agents.close()
        await asyncio.to_thread(elector.release)
        api.close()
    return 1 if elector.lost else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lorafleet-operator",
        description="Reconcile LoraAdapters onto the node agents of LoraFleets. Configured by "
                    "LORAFLEET_* environment variables (see docs/operator.md).")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                                             "KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--namespace", action="append", default=[],
                        help="namespace to manage (repeatable; overrides "
                             "LORAFLEET_WATCH_NAMESPACES)")
    args = parser.parse_args(argv)
    if args.kubeconfig:
        # kopf logs in on its own (through the kubernetes client's KUBECONFIG lookup).
        os.environ["KUBECONFIG"] = args.kubeconfig
    settings = Settings.from_env()
    if args.namespace:
        settings = dataclasses.replace(settings, namespaces=tuple(args.namespace))
    configure_logging(settings.log_level.upper())
    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    log.info("lorafleet-operator %s: namespaces %s, lease %s/%s", settings.identity,
             ",".join(settings.namespaces), settings.lease_namespace, settings.lease_name)
    return asyncio.run(run(settings, args.kubeconfig))


if __name__ == "__main__":
    sys.exit(main())
