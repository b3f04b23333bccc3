"""The control-plane test harness: re-exports :mod:`lorafleet_operator.localcluster`.

The runner itself is product code (the local demo starts the same control plane); tests keep
importing it from here. See docs/kube-test-harness.md.
"""

from lorafleet_operator.localcluster import (  # noqa: F401 - re-exported for the tests
    ADMIN_USER,
    BINARIES,
    BUILD_SCRIPT,
    LOCAL_NODE,
    REPO_ROOT,
    ControlPlane,
    HarnessError,
    KubectlError,
    find_bin_dir,
    free_port,
    make_pki,
    running_control_plane,
)
