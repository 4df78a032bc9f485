"""kvd failing under a real vLLM: vLLM recomputes, every request completes, outputs correct.

One engine per case (local prefix caching off, so every hit is kvd's): it computes the prompts
once (saving their chunks into kvd), runs them again (loading them), then new prompts. Once in
the run, a fault is injected (tests/vllm/fault_connector.py): every chunk evicted between vLLM's
scheduling (on kvd's lookup) and the load; kvd killed in the middle of a load (its first chunk
arrived, the lease held, the other chunks still to come), with async and with in-step loads;
kvd killed in the middle of a step's saves. A killed kvd stays dead for the rest of the run:
lookups and saves fail and vLLM serves every request without kvd."""

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


CASES = {  # id: (fault, fault_at, async_load)
    "evict-async": ("evict", "load", True),
    "kill-mid-load-async": ("kill", "get", True),
    "kill-mid-load-in-step": ("kill", "get", False),
    "kill-mid-save": ("kill", "put", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fault_is_recomputed(daemon, tmp_path, case):
    fault, fault_at, async_load = CASES[case]
    ref = reference(tmp_path)
    cfg = kvd_config(daemon, fault=fault, fault_at=fault_at, fault_pid=daemon.proc.pid,
                     kvd_async_load=async_load)
    out = run_engine(tmp_path, "faulty", STEPS, kvd=cfg, connector="FaultyKvdConnector",
                     module="fault_connector")
    for name in ("first", "again", "later"):
        for i, (want, got) in enumerate(zip(ref[name], out["results"][name])):
            assert_same_output(want, got, f"{case}: {name} {i}")
    if fault_at != "put":  # the connector said which tokens vLLM recomputes
        assert "recomputed" in out["log"]
    if fault == "kill":
        assert daemon.proc.poll() is not None
        assert "vLLM goes on without it" in out["log"]
        after = ("again", "later") if fault_at == "put" else ("later",)
        assert all(r["num_cached_tokens"] == 0 for n in after for r in out["results"][n])
