"""One real vLLM engine (its own process) running a job, for the vllm tests.

    python vllm_runner.py JOB.json OUT.json

JOB: {"model": HF folder, "kvd": kv_connector_extra_config or null (no connector),
      "connector": class (default KvdConnector), "module": its module (default kvd.vllm),
      "engine": extra vllm.LLM arguments, "steps": [...]}
steps, in order, on the one engine:
  {"generate": NAME, "prompts": [[token ids], ...], "max_tokens": N,   one batch (concurrent)
   "prompt_logprobs": K}  also the log-probs of the prompt tokens vLLM computes (K top ids each;
                          loads from kvd stay on: vLLM's default skips every cache then)
  {"kill": PID}                                                         SIGKILL a process
OUT: {"results": {NAME: [{"tokens", "num_cached_tokens", "top5", "prompt"}]}, "metrics": {...},
      "start_s": engine start seconds, "steps_s": [seconds per step]}
top5: the first generated token's 5 most likely ids -> logprob. prompt (with prompt_logprobs):
per prompt position, {id: [logprob, rank]} of the prompt token and the K most likely, null where
vLLM did not compute it (the first token, tokens loaded from kvd).
"""

import json
import os
import signal
import sys
import time

import torch  # noqa: F401  (before kvd: kvd's client library brings its own CUDA/NCCL)


def main():
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams
    kwargs = dict(model=job["model"], dtype="bfloat16", max_model_len=2048, enforce_eager=True,
                  seed=0, enable_prefix_caching=False, disable_log_stats=False)
    kwargs.update(job.get("engine", {}))
    if job.get("kvd") is not None:
        from vllm.config import KVTransferConfig
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=job.get("connector", "KvdConnector"),
            kv_connector_module_path=job.get("module", "kvd.vllm"), kv_role="kv_both",
            kv_connector_extra_config=job["kvd"],
            # kvd is a best-effort cache: blocks it could not fill are recomputed (vLLM's
            # default policy, "fail", aborts the request instead).
            kv_load_failure_policy="recompute")
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    out = {"start_s": time.monotonic() - t0, "results": {}, "steps_s": []}
    for step in job["steps"]:
        t = time.monotonic()
        if "generate" in step:
            extra = {}
            if "prompt_logprobs" in step:
                extra = {"prompt_logprobs": step["prompt_logprobs"],
                         "skip_reading_prefix_cache": False}
            params = SamplingParams(max_tokens=step.get("max_tokens", 12), temperature=0,
                                    logprobs=5, ignore_eos=True, **extra)
            outputs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], params,
                                   use_tqdm=False)
            out["results"][step["generate"]] = [_result(o) for o in outputs]
        elif "kill" in step:
            os.kill(int(step["kill"]), signal.SIGKILL)
        else:
            raise ValueError(f"unknown step {step}")
        out["steps_s"].append(time.monotonic() - t)
    out["metrics"] = _metrics(llm)
    with open(out_path, "w") as f:
        json.dump(out, f)


def _result(o):
    c = o.outputs[0]
    first = c.logprobs[0] if c.logprobs else {}
    out = {"tokens": list(c.token_ids), "num_cached_tokens": o.num_cached_tokens or 0,
           "top5": {str(k): float(v.logprob) for k, v in first.items()}}
    if o.prompt_logprobs is not None:
        out["prompt"] = [None if p is None else
                         {str(k): [float(v.logprob), int(v.rank)] for k, v in p.items()}
                         for p in o.prompt_logprobs]
    return out


def _metrics(llm):
    found = {}
    try:
        for m in llm.get_metrics():
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                found[m.name] = found.get(m.name, 0) + value
    except Exception as e:  # noqa: BLE001 - metrics are informative only
        found["error"] = repr(e)
    return found


if __name__ == "__main__":
    main()
