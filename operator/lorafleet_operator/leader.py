"""Leader election on a coordination.k8s.io/v1 Lease: of several replicas only one acts.

The algorithm is client-go's: a replica takes the Lease when it is absent, released, or has
not changed for ``leaseDurationSeconds`` *as observed by this replica's own monotonic clock*
(never comparing another replica's wall-clock renewTime with ours); writes carry the
resourceVersion, so two contenders cannot both win. The leader renews every
``duration / 5``; if it cannot renew within ``2/3 · duration`` it has lost and must stop acting
before anybody else may take over. On a clean shutdown it releases the Lease at once.

Needs only: create leases, get/update the one named Lease (the chart's leader-election Role).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lorafleet_operator import metrics
from lorafleet_operator.config import Settings
from lorafleet_operator.kube import read_json

log = logging.getLogger("lorafleet.operator.leader")

GROUP, VERSION, PLURAL = "coordination.k8s.io", "v1", "leases"
#: Writes a release tries before giving up on a Lease that keeps changing under it.
RELEASE_ATTEMPTS = 3


def micro_time(now: dt.datetime | None = None) -> str:
    """A metav1.MicroTime string."""
    now = now or dt.datetime.now(dt.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquire, hold and release one Lease under this replica's identity."""

    def __init__(self, api: client.ApiClient, settings: Settings) -> None:
        self._custom = client.CustomObjectsApi(api)
        self.name = settings.lease_name
        self.namespace = settings.lease_namespace
        self.identity = settings.identity
        self.duration_s = settings.lease_duration_s
        self.retry_s = max(self.duration_s / 5, 0.2)
        self.renew_deadline_s = self.duration_s * 2 / 3
        self.leading = False
        self.lost = False
        self._observed: str | None = None
        self._observed_at = 0.0

    # ---- one attempt ------------------------------------------------------------------------

    def _get(self) -> dict[str, Any] | None:
        try:
            response = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, _preload_content=False, _request_timeout=self.retry_s * 2
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return read_json(response)

    def _create(self) -> bool:
        now = micro_time()
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(round(self.duration_s), 1),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }
        try:
            self._custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body, _request_timeout=self.retry_s * 2)
        except ApiException as err:
            if err.status == 409:  # somebody created it first
                return False
            raise
        return True

    def _replace(self, lease: dict[str, Any]) -> bool:
        try:
            self._custom.replace_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, lease, _request_timeout=self.retry_s * 2
            )
        except ApiException as err:
            if err.status == 409:  # changed since we read it: somebody else wrote first
                return False
            raise
        return True

    def try_acquire_or_renew(self) -> bool:
        """One step; True when this replica holds the Lease afterwards."""
        lease = self._get()
        if lease is None:
            return self._create()
        spec = lease.setdefault("spec", {})
        record = json.dumps(spec, sort_keys=True)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.duration_s)
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            return False
        now = micro_time()
        if holder != self.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(holderIdentity=self.identity, renewTime=now, leaseDurationSeconds=max(round(self.duration_s), 1))
        return self._replace(lease)

    # ---- the loops ----------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Block until this replica is the leader."""
        announced = False
        while True:
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    break
            except ApiException as err:
                log.warning("leader election: %s %s", err.status, err.reason)
            if not announced:
                log.info("waiting for leadership of lease %s/%s", self.namespace, self.name)
                announced = True
            await asyncio.sleep(self.retry_s)
        self.leading = True
        metrics.LEADER.set(1)
        log.info("became leader (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)

    async def hold(self, on_lost: Callable[[], None]) -> None:
        """Renew until it fails for longer than the renew deadline; then call ``on_lost``."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.retry_s)
            try:
                if await asyncio.to_thread(self.try_acquire_or_renew):
                    last = time.monotonic()
                    continue
            except Exception as err:
                log.warning("leader election: renewing failed: %s", err)
            if time.monotonic() - last > self.renew_deadline_s:
                self.leading, self.lost = False, True
                metrics.LEADER.set(0)
                log.error("lost leadership of lease %s/%s; stopping", self.namespace, self.name)
                on_lost()
                return

    def release(self) -> None:
        """Give the Lease up (holder cleared) so another replica takes over at once. A write
        that conflicts (a renewal of ours still in flight landed after the read) is tried
        again on the Lease as it is now, as long as this replica holds it."""
        if not self.leading:
            return
        try:
            for _ in range(RELEASE_ATTEMPTS):
                lease = self._get()
                if not lease or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    break
                lease["spec"].update(holderIdentity="", leaseDurationSeconds=1, renewTime=micro_time())
                if self._replace(lease):
                    log.info("released lease %s/%s", self.namespace, self.name)
                    break
            else:
                log.warning(
                    "leader election: release failed: lease %s/%s changed at each of %d attempts",
                    self.namespace,
                    self.name,
                    RELEASE_ATTEMPTS,
                )
        except ApiException as err:
            log.warning("leader election: release failed: %s %s", err.status, err.reason)
        self.leading = False
        metrics.LEADER.set(0)
