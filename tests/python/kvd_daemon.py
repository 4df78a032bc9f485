"""A real kvd process for the Python tests: a temp topology, an ephemeral TCP port (and, with
unix=True, a unix socket in the temp dir: the shared-memory path), and the ready file
(`kvd --ready-file`). KVD_BINARY names the daemon (ctest sets it)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import tied_popen  # noqa: E402  (kvd dies with the test process, however it ends)

TOPOLOGY = """\
node: {node}
transport: {{backend: ucx, ucx_tls: "sm,tcp", net_devices: lo}}
models:
  - name: stories260k
    layout: {{layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, dtype: float32,
             rope: {{theta: 10000, pairing: interleaved, scaling: none}}}}
  - name: tiny-bf16
    layout: {{layers: 2, kv_heads: 2, q_heads: 4, head_dim: 16, dtype: bfloat16,
             rope: {{theta: 10000, pairing: halves, scaling: none}}}}
  - name: smollm2-135m
    layout: {{layers: 30, kv_heads: 3, q_heads: 9, head_dim: 64, dtype: bfloat16,
             rope: {{theta: 100000, pairing: halves, scaling: none}}}}
    compression: {smollm_compression}
{extra_models}chunk_tokens: {chunk_tokens}
tiers:
  host: {{capacity: {capacity}, prefault: false{host_extra}}}
{extra}
"""


class KvdDaemon:
    def __init__(self, node="pytest", chunk_tokens=256, capacity="32MiB", extra="", segment="",
                 shared_memory=True, unix=False, listen="127.0.0.1:0", smollm_compression="off",
                 extra_models=""):
        """segment: tiers.host.segment ("" = kvd's default, 64 MiB: above the default capacity,
        so no shared-memory arena); shared_memory: tiers.host.shared_memory; listen: kvd's TCP
        address (default an ephemeral port; another kvd's address restarts it there);
        smollm_compression: the compression policy of model smollm2-135m (YAML flow form);
        extra_models: more entries of `models:` (YAML lines, each starting "  - name: ")."""
        self.binary = os.environ.get("KVD_BINARY", "kvd")
        self.dir = tempfile.mkdtemp(prefix="kvd-pytest-")
        self.config_path = os.path.join(self.dir, "topology.yaml")
        with open(self.config_path, "w") as f:
            host_extra = (f", segment: {segment}" if segment else "") + (
                "" if shared_memory else ", shared_memory: false")
            f.write(TOPOLOGY.format(node=node, chunk_tokens=chunk_tokens, capacity=capacity,
                                    host_extra=host_extra, extra=extra,
                                    smollm_compression=smollm_compression,
                                    extra_models=extra_models))
        ready = os.path.join(self.dir, "ready.json")
        self.log_path = os.path.join(self.dir, "kvd.log")
        self._log = open(self.log_path, "w")
        unix_path = os.path.join(self.dir, "kvd.sock") if unix else "none"
        self.proc = tied_popen.popen(
            [self.binary, "--config", self.config_path, "--listen", listen, "--unix",
             unix_path, "--ready-file", ready], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log()  # before stop() removes the folder
                self.stop()
                raise RuntimeError("kvd did not start:\n" + log)
            time.sleep(0.05)
        with open(ready) as f:
            info = json.load(f)
        self.address = info["tcp"]
        self.unix_address = "unix:" + info["unix"] if info.get("unix") else ""
        self.metrics_address = info.get("metrics", "")

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        stop_process(self.proc, self._log, self.dir)


def stop_process(proc, log, folder):
    """SIGTERM (SIGKILL after 10 s) and reap `proc`, close its `log`, remove its `folder`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    shutil.rmtree(folder, ignore_errors=True)
