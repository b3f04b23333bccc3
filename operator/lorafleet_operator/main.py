"""``lorafleet-operator``: leader election, metrics, then kopf (standalone, namespaced).

Only the replica holding the Lease runs kopf at all, so only one ever acts; a replica that
loses the Lease stops kopf and exits non-zero (its pod restarts and waits as a follower). kopf
runs ``--standalone`` (no peering CRDs) and only in the watched namespaces, matching the
chart's namespaced RBAC. Configuration comes from the environment (see :mod:`config`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import kopf
from prometheus_client import start_http_server

from lorafleet_operator import metrics
from lorafleet_operator.agent_client import AgentClients
from lorafleet_operator.config import Settings
from lorafleet_operator.failures import KUBE_API_ERRORS, kube_reason
from lorafleet_operator.kube import Kube, make_api_client
from lorafleet_operator.leader import LeaderElector
from lorafleet_operator.reasons import EventReason
from lorafleet_operator.runtime import Runtime

log = logging.getLogger("lorafleet.operator")

#: Importing these registers their kopf handlers (in kopf's default registry).
HANDLER_MODULES = ("lorafleet_operator.handlers", "lorafleet_operator.drift")


def configure_logging(level: str) -> None:
    """Our loggers at ``level``; kopf's own chatter (a line per handler) and the access log
    of ``/healthz`` (a line per liveness probe, every few seconds) only when debugging."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":
        for name in ("kopf", "kopf.objects", "kopf.activities", "kopf.reactor", "aiohttp.access"):
            logging.getLogger(name).setLevel(logging.WARNING)


@kopf.on.cleanup()
async def release_stop_flag(memo: kopf.Memo, **_: Any) -> None:
    """Set the stop flag :func:`run` gave kopf when kopf stops for another reason (SIGTERM).
    kopf leaves its task waiting on that flag pending, then waits 5 s for such "hung" tasks
    before it cancels them: every shutdown took 5 s longer (kopf 1.45, ``stop_flag_checker``)."""
    memo["stop"].set()


async def usable_namespaces(kube: Kube, settings: Settings) -> list[str]:
    """The watched namespaces kopf can watch. Each unusable one is reported — a log line,
    ``lorafleet_unusable_namespaces{namespace,problem}`` and a Warning Event on the leader
    Lease — and a forbidden one is skipped, so the others keep working (a watch that is
    forbidden would retry forever). A missing one stays watched: the chart's cluster-scoped
    grants allow watching it, and it is served once it is created."""
    usable = []
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": settings.lease_name}
    for namespace in settings.namespaces:
        try:
            problem = await kube.namespace_problem(namespace)
        except KUBE_API_ERRORS as err:  # the API server is down or busy: kopf's watch retries
            log.warning("watched namespace %s could not be checked (%s): watching it", namespace, kube_reason(err))
            problem = ""
        if problem:
            what = (
                "skipped: the operator may not list its LoraAdapters (RBAC)" if problem == "forbidden" else "watched, served once it exists"
            )
            log.warning("watched namespace %s is %s: %s", namespace, problem, what)
            metrics.UNUSABLE_NAMESPACES.labels(namespace=namespace, problem=problem).set(1)
            try:
                await kube.post_event(
                    settings.lease_namespace,
                    lease,
                    "Warning",
                    EventReason.WATCHED_NAMESPACE_UNUSABLE,
                    f"watched namespace {namespace} is {problem}: {what}",
                )
            except KUBE_API_ERRORS as err:
                log.warning("could not post the event: %s", kube_reason(err))
        if problem != "forbidden":
            usable.append(namespace)
    return usable


@contextlib.asynccontextmanager
async def standby_health(port: int) -> AsyncIterator[None]:
    """While waiting for the Lease, ``/healthz`` answers 200 (a standby is alive while it
    waits); it closes before kopf serves its own liveness endpoint on the same port."""
    if not port:
        yield
        return

    async def alive(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get("/healthz", alive)])
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def run(settings: Settings, kubeconfig: str | None = None) -> int:
    """Elect, then operate until stopped (signal) or leadership is lost; returns an exit code.

    If kopf's reconcile loop fails, the leader releases the Lease and exits 1 at once: a
    standby takes over instead of a leader that renews its Lease while doing nothing."""
    for module in HANDLER_MODULES:
        importlib.import_module(module)
    api = make_api_client(kubeconfig)
    elector = LeaderElector(api, settings)
    async with standby_health(settings.health_port):
        await elector.acquire()
    stop = asyncio.Event()
    holding = asyncio.create_task(elector.hold(stop.set))
    runtime = Runtime(settings=settings, kube=Kube(api), agents=AgentClients(settings))
    failed = False
    try:
        namespaces = await usable_namespaces(runtime.kube, settings)
        if not namespaces:
            log.error("no watched namespace is usable (%s); stopping", ",".join(settings.namespaces))
            return 1
        liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
        await kopf.operator(
            standalone=True,
            clusterwide=False,
            namespaces=namespaces,
            memo=kopf.Memo(runtime=runtime, stop=stop),
            stop_flag=stop,
            liveness_endpoint=liveness,
        )
    except Exception:  # kopf re-raises what failed one of its root tasks (e.g. a watcher)
        failed = True
        log.exception("kopf's reconcile loop failed; releasing the lease and exiting")
    finally:
        holding.cancel()
        await runtime.agents.close()
        await asyncio.to_thread(elector.release)
        api.close()
    return 1 if elector.lost or failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lorafleet-operator",
        description="Reconcile LoraAdapters onto the node agents of LoraFleets. Configured by "
        "LORAFLEET_* environment variables (see docs/operator.md).",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG or ~/.kube/config)")
    parser.add_argument(
        "--namespace", action="append", default=[], help="namespace to manage (repeatable; overrides LORAFLEET_WATCH_NAMESPACES)"
    )
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
    log.info(
        "lorafleet-operator %s: namespaces %s, lease %s/%s",
        settings.identity,
        ",".join(settings.namespaces),
        settings.lease_namespace,
        settings.lease_name,
    )
    return asyncio.run(run(settings, args.kubeconfig))


if __name__ == "__main__":
    sys.exit(main())
