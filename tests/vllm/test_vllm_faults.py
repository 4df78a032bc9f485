"""kvd failing under a real vLLM: vLLM recomputes, every request completes, outputs correct.

One engine per case (local prefix caching off, so every hit is kvd's): it computes the prompts
once (saving their chunks into kvd), then runs them again, and its first load meets a fault
injected between vLLM's scheduling (on kvd's lookup) and the load
(tests/vllm/fault_connector.py): every chunk evicted, or kvd killed. A killed kvd stays dead for
the engine's later requests: their lookups and saves fail and vLLM serves them without kvd."""

import pytest

from conftest import assert_same_output, kvd_config, prompt, run_engine

PROMPTS = [prompt(200 + i, n) for i, n in enumerate((600, 513, 300))]
LATER = [prompt(300, 700), PROMPTS[0]]
STEPS = [{"generate": "first", "prompts": PROMPTS}, {"generate": "again", "prompts": PROMPTS},
         {"generate": "later", "prompts": LATER}]
_REF = {}


def reference(tmp_path):
    """vLLM without kvd, once per module."""
    if "ref" not in _REF:
        _REF["ref"] = run_engine(tmp_path, "ref", STEPS)["results"]
    return _REF["ref"]


@pytest.mark.parametrize("fault,async_load", [("evict", True), ("kill", True),
                                              ("kill", False)],
                         ids=["evict-async", "kill-async", "kill-in-step"])
def test_fault_between_schedule_and_load_is_recomputed(daemon, tmp_path, fault, async_load):
    ref = reference(tmp_path)
    cfg = kvd_config(daemon, fault=fault, fault_pid=daemon.proc.pid, kvd_async_load=async_load)
    out = run_engine(tmp_path, "faulty", STEPS, kvd=cfg, connector="FaultyKvdConnector",
                     module="fault_connector")
    for name in ("first", "again", "later"):
        for i, (want, got) in enumerate(zip(ref[name], out["results"][name])):
            assert_same_output(want, got, f"{fault}: {name} {i}")
    assert "recomputed" in out["log"]  # the connector said which tokens vLLM recomputes
    if fault == "kill":
        assert daemon.proc.poll() is not None
        assert "vLLM goes on without it" in out["log"]
        assert all(r["num_cached_tokens"] == 0 for r in out["results"]["later"])
