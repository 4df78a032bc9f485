"""`import kvd` maps no CUDA library, and works before or after `import torch`: libkvd_client and
the _kvd extension load the CUDA runtime and NCCL on first device use, not at import. Each case
runs in a fresh interpreter, where nothing else has loaded a library yet.

torch: the first Python among $KVD_TORCH_PYTHON and <repository>/.cache/vllm-venv/bin/python
(deploy's vLLM venv) that imports torch; without one the torch cases skip and say so, or fail
with KVD_REQUIRE_TORCH=1 (ctest vllm_import_order runs this file in the vLLM venv, label vllm).
Were NCCL mapped at `import kvd` (a NEEDED entry of the extension or libkvd_client), torch's
import after it would fail: the CUDA toolkit's NCCL 2.28 lacks a symbol torch 2.13's
libtorch_cuda.so needs (`undefined symbol: ncclCommResume`)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# The libraries a CPU process must not map: the CUDA runtime, NCCL, the driver, kvd's kernels.
CUDA_LIBRARIES = ("libcudart", "libnccl", "libcuda.so", "libkvd_kernels_cuda")

MAPS = """
import sys
names = {names!r}
lines = [l.split()[-1] for l in open("/proc/self/maps") if "/" in l]
found = sorted({{p for p in lines if any(n in p.rsplit("/", 1)[-1] for n in names)}})
print("\\n".join(found))
"""


def run(python, code, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=240,
                          env=env)


def torch_python():
    """(python, None) for an interpreter that imports torch, else (None, why)."""
    candidates = [os.environ.get("KVD_TORCH_PYTHON", ""),
                  os.path.join(REPO, ".cache", "vllm-venv", "bin", "python")]
    tried = []
    for python in [c for c in candidates if c]:
        if not os.path.exists(python):
            tried.append(f"{python}: absent")
            continue
        r = run(python, "import torch")
        if r.returncode == 0:
            return python, None
        tried.append(f"{python}: import torch failed: {r.stderr.strip().splitlines()[-1:]}")
    tried.append(f"{sys.executable}: the tests' own Python (no torch installed for it)")
    return None, "no Python with torch (" + "; ".join(tried) + "); deploy/vllm installs one"


def test_import_kvd_maps_no_cuda_library():
    code = "import kvd\n" + MAPS.format(names=CUDA_LIBRARIES)
    r = run(sys.executable, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", "import kvd mapped:\n" + r.stdout


def test_a_client_moving_host_buffers_maps_no_cuda_library(daemon):
    code = f"""
import numpy as np, kvd
with kvd.connect({daemon.address!r}, model="stories260k", ucx_tls="sm,tcp",
                 net_devices="lo") as c:
    chain = c.hash(np.arange(256, dtype=np.int32))
    data = np.random.default_rng(7).integers(0, 256, c.chunk_bytes, dtype=np.uint8)
    c.put(chain[0], 256, data)
    assert c.lookup(chain).matched_chunks == 1
""" + MAPS.format(names=CUDA_LIBRARIES)
    r = run(sys.executable, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", "a client moving host buffers mapped:\n" + r.stdout


@pytest.mark.parametrize("order", [("kvd", "torch"), ("torch", "kvd")],
                         ids=["kvd_then_torch", "torch_then_kvd"])
def test_kvd_and_torch_import_in_either_order(order):
    python, why = torch_python()
    if python is None:
        if os.environ.get("KVD_REQUIRE_TORCH") == "1":  # ctest vllm_import_order: the venv is there
            pytest.fail(why)
        pytest.skip(why)
    first, second = order
    code = f"""
import {first}
import {second}
import torch, kvd
t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
assert float((t * 2).sum()) == 30.0
print(torch.__version__, kvd.__version__, torch.cuda.is_available())
"""
    r = run(python, code)  # kvd from PYTHONPATH (ctest points it at the built package)
    assert r.returncode == 0, f"import {first}; import {second}:\n{r.stderr}"


def test_kvd_vllm_raises_the_import_error_of_a_vllm_that_does_not_fit(tmp_path):
    # An installed vLLM whose connector base cannot be imported (a vLLM of another shape): kvd.vllm
    # raises that error instead of falling back to its stand-in classes.
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('vllm: this build does not fit (test stand-in)')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = run(sys.executable, "import kvd.vllm", env)
    assert r.returncode != 0, "kvd.vllm imported over a vLLM that does not fit"
    assert "ImportError: vllm: this build does not fit (test stand-in)" in r.stderr, r.stderr
