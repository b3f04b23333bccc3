"""`helm uninstall`'s pre-delete hook: let the operator release what it holds before it goes.

Runs in the operator image (the kubernetes client), in-cluster, before helm deletes anything,
so the operator still runs. Environment: NAMESPACE, FLEET (the chart's LoraFleet), FINALIZER
(the operator's, lorafleet.dev/unload), TIMEOUT_S.

1. Delete every LoraAdapter of NAMESPACE whose spec.fleetRef.name is FLEET: the operator
   unloads each from the agents and releases its finalizer.
2. Delete the LoraFleet FLEET: the operator stops its drift check and releases its finalizer.
3. Whatever still carries FINALIZER once TIMEOUT_S have passed (no operator running, or an
   agent that never answers) has that finalizer removed, so nothing stays Terminating after
   the operator is gone; each such object is named in the output.

Exit status 0 when nothing of the chart's fleet is left; 1 on a Kubernetes API error or when
another finalizer still holds an object (helm then
reports the failed hook, and `helm uninstall --no-hooks` skips it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

GROUP, VERSION = "lorafleet.dev", "v1alpha1"


Objects = list[dict[str, Any]]
# Past the deadline, how long the objects whose finalizer was removed may take to go.
RELEASED_GONE_S = 30


@dataclass(frozen=True)
class Settings:
    """What the hook cleans up and how long it waits for the operator (the environment's)."""

    namespace: str
    fleet: str
    finalizer: str
    timeout_s: float

    @classmethod
    def from_environment(cls) -> Settings:
        env = os.environ
        return cls(env["NAMESPACE"], env["FLEET"], env["FINALIZER"], float(env.get("TIMEOUT_S", "120")))


def wait_gone(list_them: Callable[[], Objects], deadline: float) -> Objects:
    """Poll until `list_them()` is empty or `deadline` (time.monotonic()) passes; what is left."""
    while (left := list_them()) and time.monotonic() < deadline:
        time.sleep(1)
    return left


class Cleanup:
    """The chart's fleet and its adapters, deleted through the operator, released past the deadline."""

    def __init__(self, api: client.CustomObjectsApi, settings: Settings) -> None:
        self.api, self.settings = api, settings
        self.deadline = time.monotonic() + settings.timeout_s

    def run(self) -> list[str]:
        """Delete the adapters, then the fleet; what is still there (held by other finalizers)."""
        settings = self.settings
        found = self.adapters()
        for a in found:
            self.delete("loraadapters", a["metadata"]["name"])
        print(f"deleting {len(found)} LoraAdapter(s) of fleet {settings.namespace}/{settings.fleet}")
        stuck = self.settle("loraadapters", self.adapters)
        if self.the_fleet():
            self.delete("lorafleets", settings.fleet)
            print(f"deleting LoraFleet {settings.namespace}/{settings.fleet}")
        return stuck + self.settle("lorafleets", self.the_fleet)

    def adapters(self) -> Objects:
        """The namespace's LoraAdapters whose spec.fleetRef.name is the chart's fleet."""
        items = self.api.list_namespaced_custom_object(GROUP, VERSION, self.settings.namespace, "loraadapters")["items"]
        return [a for a in items if (a.get("spec", {}).get("fleetRef") or {}).get("name") == self.settings.fleet]

    def the_fleet(self) -> Objects:
        """The chart's LoraFleet, or nothing once it is gone."""
        try:
            return [self.api.get_namespaced_custom_object(GROUP, VERSION, self.settings.namespace, "lorafleets", self.settings.fleet)]
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise

    def delete(self, plural: str, name: str) -> None:
        try:
            self.api.delete_namespaced_custom_object(GROUP, VERSION, self.settings.namespace, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def settle(self, plural: str, list_them: Callable[[], Objects]) -> list[str]:
        """Wait for the operator; past the deadline release ours; return what is still there."""
        left = wait_gone(list_them, self.deadline)
        if left:
            for obj in left:
                self.release(plural, obj)
            left = wait_gone(list_them, time.monotonic() + RELEASED_GONE_S)
        return [f"{plural}/{o['metadata']['name']} (finalizers {o['metadata'].get('finalizers')})" for o in left]

    def release(self, plural: str, obj: dict[str, Any]) -> None:
        """Remove the operator's finalizer from `obj`, if it still carries it."""
        finalizer, meta = self.settings.finalizer, obj["metadata"]
        kept = [f for f in meta.get("finalizers") or [] if f != finalizer]
        if kept == (meta.get("finalizers") or []):
            return
        patch = {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}}
        try:
            self.api.patch_namespaced_custom_object(GROUP, VERSION, self.settings.namespace, plural, meta["name"], patch)
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone meanwhile, or changed: looked at again
                raise
        timeout_s = self.settings.timeout_s
        print(f"removed finalizer {finalizer} from {plural}/{meta['name']}: the operator did not release it within {timeout_s:.0f} s")


def main() -> int:
    settings = Settings.from_environment()
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config()
    else:
        config.load_incluster_config()
    try:
        stuck = Cleanup(client.CustomObjectsApi(), settings).run()
    except ApiException as exc:
        print(f"uninstall-cleanup: Kubernetes API error {exc.status} {exc.reason}: {exc.body}", file=sys.stderr)
        return 1
    if stuck:
        print(f"uninstall-cleanup: still present (held by other finalizers): {', '.join(stuck)}", file=sys.stderr)
        return 1
    print(f"nothing of fleet {settings.namespace}/{settings.fleet} is left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
