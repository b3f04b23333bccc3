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
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

GROUP, VERSION = "lorafleet.dev", "v1alpha1"


def main() -> int:
    ns, fleet, finalizer = os.environ["NAMESPACE"], os.environ["FLEET"], os.environ["FINALIZER"]
    timeout_s = float(os.environ.get("TIMEOUT_S", "120"))
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config()
    else:
        config.load_incluster_config()
    api = client.CustomObjectsApi()

    def adapters() -> list[dict[str, Any]]:
        items = api.list_namespaced_custom_object(GROUP, VERSION, ns, "loraadapters")["items"]
        return [a for a in items if (a.get("spec", {}).get("fleetRef") or {}).get("name") == fleet]

    def the_fleet() -> list[dict[str, Any]]:
        try:
            return [api.get_namespaced_custom_object(GROUP, VERSION, ns, "lorafleets", fleet)]
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise

    def delete(plural: str, name: str) -> None:
        try:
            api.delete_namespaced_custom_object(GROUP, VERSION, ns, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def wait_gone(list_them: Any, deadline: float) -> list[dict[str, Any]]:
        while (left := list_them()) and time.monotonic() < deadline:
            time.sleep(1)
        return left

    def release(plural: str, objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            meta = obj["metadata"]
            kept = [f for f in meta.get("finalizers") or [] if f != finalizer]
            if kept == (meta.get("finalizers") or []):
                continue
            patch = {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}}
            try:
                api.patch_namespaced_custom_object(GROUP, VERSION, ns, plural, meta["name"], patch)
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone meanwhile, or changed: looked at again
                    raise
            print(f"removed finalizer {finalizer} from {plural}/{meta['name']}: the operator did not release it within {timeout_s:.0f} s")

    deadline = time.monotonic() + timeout_s

    def settle(plural: str, list_them: Any) -> list[str]:
        """Wait for the operator; past the deadline release ours; return what is still there."""
        left = wait_gone(list_them, deadline)
        if left:
            release(plural, left)
            left = wait_gone(list_them, time.monotonic() + 30)
        return [f"{plural}/{o['metadata']['name']} (finalizers {o['metadata'].get('finalizers')})" for o in left]

    try:
        found = adapters()
        for a in found:
            delete("loraadapters", a["metadata"]["name"])
        print(f"deleting {len(found)} LoraAdapter(s) of fleet {ns}/{fleet}")
        stuck = settle("loraadapters", adapters)
        if the_fleet():
            delete("lorafleets", fleet)
            print(f"deleting LoraFleet {ns}/{fleet}")
        stuck += settle("lorafleets", the_fleet)
    except ApiException as exc:
        print(f"uninstall-cleanup: Kubernetes API error {exc.status} {exc.reason}: {exc.body}", file=sys.stderr)
        return 1
    if stuck:
        print(f"uninstall-cleanup: still present (held by other finalizers): {', '.join(stuck)}", file=sys.stderr)
        return 1
    print(f"nothing of fleet {ns}/{fleet} is left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
