"""KvdConnector with one injected fault, for the vllm fault tests: the real connector in a real
vLLM, except that once, at the point `fault_at` of kv_connector_extra_config names, it runs the
fault `fault` names:
  "fault": "kill"   SIGKILL the kvd process "fault_pid"
  "fault": "evict"  `kvdctl evict --model <kvd_model>` (KVDCTL_BINARY): every chunk gone
  "fault_at": "load"  just before the first load reaches kvd (after vLLM scheduled it on kvd's
                      word; the default)
              "get"   after the first chunk of a load arrived: the load's lease is held and its
                      other chunks are still to come
              "put"   after the first chunk of a step's saves was stored, the rest still to go
"""

import os
import signal
import subprocess
import threading

from kvd.vllm import KvdConnector

_fired = False
_lock = threading.Lock()


def _fire(cfg):
    global _fired
    with _lock:
        if _fired:
            return
        _fired = True
        fault = cfg.get("fault")
        if fault == "kill":
            os.kill(int(cfg["fault_pid"]), signal.SIGKILL)
        elif fault == "evict":
            subprocess.run([os.environ.get("KVDCTL_BINARY", "kvdctl"), "--addr",
                            cfg["kvd_address"], "evict", "--model", cfg["kvd_model"]],
                           check=True, capture_output=True)
        else:
            raise ValueError(f"unknown fault {fault!r}")


class _FaultyClient:
    """A kvd client whose first get or put (the one `fault_at` names) fires the fault once it
    returned; every other call goes to the real client."""

    def __init__(self, client, cfg):
        self._client, self._cfg = client, cfg

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get(self, *args, **kwargs):
        out = self._client.get(*args, **kwargs)
        if self._cfg.get("fault_at") == "get":
            _fire(self._cfg)
        return out

    def put(self, *args, **kwargs):
        out = self._client.put(*args, **kwargs)
        if self._cfg.get("fault_at") == "put":
            _fire(self._cfg)
        return out


class FaultyKvdConnector(KvdConnector):
    def _new_client(self, suffix=""):
        return _FaultyClient(super()._new_client(suffix), self._cfg)

    def _stage(self, c, plan):
        if self._cfg.get("fault_at", "load") == "load":
            _fire(self._cfg)
        return super()._stage(c, plan)
