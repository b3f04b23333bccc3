"""The built agent image can build what triton compiles at first use on a GPU node.

Triton (3.9) compiles one C module for NVIDIA GPUs, its driver module `cuda_utils`
(triton/backends/nvidia/driver.c: device queries, module loading, and the one generic launcher
every kernel launch goes through; there is no launcher source per kernel signature), with the C
compiler on PATH, against Python's headers and triton's bundled CUDA headers, linked to
libcuda.so.1. The test builds the agent image (lorafleet_dev.images, cached by content; its
dependency layer from the build cache) and runs in it, as the image's user: the compiler is on
PATH, and triton's own `compile_so_from_file` builds `cuda_utils` with the arguments triton's
`CudaUtils` passes (its include and library directories, `libcuda.so.1`).

No GPU is needed to compile. The link needs a file named libcuda.so.1, which a GPU node's driver
provides; here it is an empty stand-in that `TRITON_LIBCUDA_PATH` points triton at (as on a node
whose ldconfig does not list libcuda). The module's cu* symbols then stay undefined and are bound
to the node's libcuda when the module is loaded, as with the driver's own library: a shared
object may leave symbols to the libraries it needs.
"""

from __future__ import annotations

import json

import pytest

from lorafleet_dev.images import ImageBuilder
from tests.kube.harness import CHECKOUT, HarnessError

#: Runs in the image: the compiler triton finds, then triton's build of its CUDA driver module.
BUILD_CUDA_UTILS = r"""
import json, os, pathlib, shutil, subprocess, sys
compiler = shutil.which("gcc")
if compiler is None:
    sys.exit("no gcc on PATH: triton cannot build its CUDA driver module on a GPU node")
stand_in = pathlib.Path("/tmp/libcuda-stand-in")
stand_in.mkdir()
subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", "/dev/null", "-o", str(stand_in / "libcuda.so.1")], check=True)
os.environ["TRITON_LIBCUDA_PATH"] = str(stand_in)
from triton.backends.nvidia import driver
from triton.runtime.build import compile_so_from_file
module = compile_so_from_file(
    os.path.join(driver.dirname, "driver.c"), "cuda_utils",
    library_dirs=driver.library_dirs(), include_dirs=driver.include_dirs, libraries=driver.libraries,
)
data = pathlib.Path(module).read_bytes()
print(json.dumps({
    "compiler": compiler,
    "module": module,
    "elf_shared_object": data[:4] == b"\x7fELF" and data[16] == 3,
    "python_module": b"PyInit_cuda_utils" in data,
    "needs_libcuda": b"libcuda.so.1" in data,
    "leaves_cu_symbols_to_libcuda": b"cuModuleLoadData" in data,
}))
"""


def test_the_agent_image_builds_tritons_cuda_driver_module() -> None:
    builder = ImageBuilder(CHECKOUT)
    try:
        image = builder.agent_image()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    done = builder.run_in_image(image, ["python", "-c", BUILD_CUDA_UTILS])
    assert done.returncode == 0, done.stderr[-4000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built["compiler"] == "/usr/bin/gcc"
    assert built["module"].startswith("/tmp/triton/"), "into TRITON_CACHE_DIR, the pod's emptyDir"
    assert built["module"].endswith("/cuda_utils.cpython-311-x86_64-linux-gnu.so")
    assert built["elf_shared_object"] and built["python_module"]
    assert built["needs_libcuda"] and built["leaves_cu_symbols_to_libcuda"]
