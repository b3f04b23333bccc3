"""Development tooling for lorafleet; never imported by the product, never shipped.

* :mod:`lorafleet_dev.checkout` — the repository checkout the tooling reads files from (CRDs,
  chart, examples, the kube build script); callers say where it is.
* :mod:`lorafleet_dev.pki` — a throwaway CA and the certificates it issues.
* :mod:`lorafleet_dev.processes` — child servers that die with their parent, free ports, waiting.
* :mod:`lorafleet_dev.controlplane` — a real etcd + kube-apiserver + kube-controller-manager on
  loopback, driven with the real kubectl and helm.
* :mod:`lorafleet_dev.kubelet` — agent Pods whose status is written the way a kubelet would.
* :mod:`lorafleet_dev.agents` — node agents (``lorafleet-agent serve``) as local processes.
* :mod:`lorafleet_dev.synthetic` — random models and PEFT adapters written without transformers.
* :mod:`lorafleet_dev.demo` — the demo (``python -m lorafleet_dev.demo``, ``bash scripts/demo.sh``).
"""
