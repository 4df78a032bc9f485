"""Shared pieces of the vllm tests: real vLLM engines (tests/vllm/vllm_runner.py, one process
each) against a real kvd (tests/python/kvd_daemon.py).

Environment (tests/vllm/CMakeLists.txt sets it): KVD_VLLM_MODEL, the HF folder of the demo
model (deploy/setup-vllm.sh converts it); PYTHONPATH with the built kvd package; KVD_BINARY,
KVDCTL_BINARY. The interpreter is the vLLM venv's."""

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
import tied_popen  # noqa: E402
from kvd_daemon import KvdDaemon  # noqa: E402

# The engines compute in float32: vLLM's CPU kernels round bfloat16 differently for other batch
# shapes on some instruction sets (measured on an AVX-512 Xeon: first-token log-probs 0.1 apart
# for a prompt that loads nothing, only batched differently, and a greedy token flipped), which
# would hide a misplaced token behind rounding noise or fail on none. In float32 that noise is
# ~1e-5, so the tests can ask for equal tokens and log-probs within 0.01.
DTYPE = "float32"
KVD_MODEL = "smollm2-135m-f32"
F32_MODEL = """\
  - name: smollm2-135m-f32
    layout: {layers: 30, kv_heads: 3, q_heads: 9, head_dim: 64, dtype: float32,
             rope: {theta: 100000, pairing: halves, scaling: none}}
"""
RUNNER = os.path.join(HERE, "vllm_runner.py")
CHUNK = 256  # kvd chunk_tokens of the test daemons
BLOCK = 128  # vLLM's block_size on its CPU backend


def model_dir():
    path = os.environ.get("KVD_VLLM_MODEL", "")
    if not os.path.isfile(os.path.join(path, "config.json")):
        pytest.skip(f"no HF model folder at {path!r} (deploy/setup-vllm.sh makes it)")
    return path


@pytest.fixture
def daemon():
    d = KvdDaemon(node="vllm-test", capacity="256MiB", shared_memory=False,
                  extra_models=F32_MODEL)
    yield d
    d.stop()


def kvd_config(daemon, model=KVD_MODEL, **extra):
    return {"kvd_address": daemon.address, "kvd_model": model, "kvd_ucx_tls": "sm,tcp",
            "kvd_net_devices": "lo", **extra}


def run_engine(tmp_path, name, steps, kvd=None, timeout_s=420, **job):
    """Runs one vLLM engine process through `steps`; returns its output (vllm_runner.py)."""
    job = {"model": model_dir(), "kvd": kvd, "steps": steps, **job}
    job["engine"] = {"dtype": DTYPE, **job.get("engine", {})}
    job_path, out_path = tmp_path / f"{name}.job.json", tmp_path / f"{name}.out.json"
    log_path = tmp_path / f"{name}.log"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    with open(log_path, "w") as log:
        proc = tied_popen.popen([sys.executable, RUNNER, str(job_path), str(out_path)],
                                stdout=log, stderr=log, env=env)
        try:
            rc = proc.wait(timeout_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"vLLM engine {name} exited {rc}:\n{tail}")
    out = json.loads(out_path.read_text())
    out["log"] = log_path.read_text()
    return out


def prompt(seed, n):
    """n token ids of the model's vocabulary, different per seed."""
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 40000, n)]


def expected_kvd_tokens(n, local=0):
    """Tokens vLLM takes from kvd for an n-token prompt whose chunks are all stored: kvd's full
    chunks, less the last prompt token (vLLM computes it), beyond a local hit."""
    return max(0, min(n // CHUNK * CHUNK, n - 1) - local)


def assert_same_output(ref, got, what):
    """Greedy tokens equal token for token, and the first token's top 5 the same with close
    log-probabilities (a wrong KV changes them long before it changes the argmax)."""
    assert got["tokens"] == ref["tokens"], f"{what}: generated {got['tokens']}, " \
        f"local vLLM {ref['tokens']}"
    top_ref = ref["top5"]
    top_got = got["top5"]
    assert set(top_got) == set(top_ref), f"{what}: first-token top 5 {top_got} vs {top_ref}"
    worst = max(abs(top_got[k] - top_ref[k]) for k in top_ref)
    assert worst < LOGPROB_TOLERANCE, f"{what}: first-token log-probs differ by {worst:.3f}: " \
        f"{top_got} vs {top_ref}"


# Loaded KV are the bits vLLM computed; on vLLM's CPU backend the log-probs then come out
# identical (measured: 0 difference). The margin allows for last-bit differences a batch of
# another composition may give elsewhere; a wrong token position moves them by whole units.
LOGPROB_TOLERANCE = 0.01
