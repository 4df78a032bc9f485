"""KvdConnector with one injected fault, for the vllm fault tests: the real connector in a real
vLLM, except that just before the first load reaches kvd (after vLLM scheduled it on kvd's
word) it runs the fault named in kv_connector_extra_config:
  "fault": "kill"   SIGKILL the kvd process "fault_pid"
  "fault": "evict"  `kvdctl evict --model <kvd_model>` (KVDCTL_BINARY): every chunk gone
"""

import os
import signal
import subprocess
import threading

from kvd.vllm import KvdConnector


class FaultyKvdConnector(KvdConnector):
    _fired = False
    _lock = threading.Lock()

    def _stage(self, c, plan):
        with FaultyKvdConnector._lock:
            if not FaultyKvdConnector._fired:
                FaultyKvdConnector._fired = True
                self._fault()
        return super()._stage(c, plan)

    def _fault(self):
        fault = self._cfg.get("fault")
        if fault == "kill":
            os.kill(int(self._cfg["fault_pid"]), signal.SIGKILL)
        elif fault == "evict":
            subprocess.run([os.environ.get("KVDCTL_BINARY", "kvdctl"), "--addr",
                            self._cfg["kvd_address"], "evict", "--model", self._cfg["kvd_model"]],
                           check=True, capture_output=True)
        else:
            raise ValueError(f"unknown fault {fault!r}")
