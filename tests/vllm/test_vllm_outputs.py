"""Greedy output of real vLLM with KV from kvd equals vLLM computing the prompt itself.

Three engines, each its own process, against one kvd: `ref` (no connector), `store` (computes
every prompt and saves its full chunks into kvd), then fresh engines that load what `store`
saved (async loads, kvd's default; and in-step loads). Prompt lengths cover chunk (256) and
block (128) boundaries: 255 (nothing to load), 256 and 512 (the load ends one token inside a
block: vLLM computes the last prompt token), 257 and 513 (block-aligned loads), 511, ~1000.
Then prefix reuse: prompts sharing a stored prefix with a new tail load the prefix."""

import pytest

from conftest import (assert_same_output, expected_kvd_tokens, kvd_config, prompt,
                      run_engine)

LENGTHS = [255, 256, 257, 511, 512, 513, 1000]
PREFIX = prompt(100, 512)
SHARED = [PREFIX + prompt(101 + i, n) for i, n in enumerate((40, 300))]


@pytest.fixture(scope="module")
def prompts():
    return [prompt(n, n) for n in LENGTHS]


def test_outputs_through_kvd_equal_local_prefill(daemon, tmp_path, prompts):
    steps = [{"generate": "lengths", "prompts": prompts}, {"generate": "shared", "prompts": SHARED}]
    ref = run_engine(tmp_path, "ref", steps)["results"]
    store = run_engine(tmp_path, "store", [{"generate": "lengths", "prompts": prompts},
                                           {"generate": "prefix", "prompts": [PREFIX]}],
                       kvd=kvd_config(daemon))
    for i, n in enumerate(LENGTHS):  # nothing was in kvd: computed like ref
        assert store["results"]["lengths"][i]["num_cached_tokens"] == 0
        assert_same_output(ref["lengths"][i], store["results"]["lengths"][i], f"store {n}")

    for mode, extra in (("async", {}), ("in-step", {"kvd_async_load": False})):
        load = run_engine(tmp_path, f"load-{mode}", steps, kvd=kvd_config(daemon, **extra))
        for i, n in enumerate(LENGTHS):
            got = load["results"]["lengths"][i]
            assert got["num_cached_tokens"] == expected_kvd_tokens(n), f"{mode} {n}"
            assert_same_output(ref["lengths"][i], got, f"{mode} load, {n}-token prompt")
        for i, p in enumerate(SHARED):
            got = load["results"]["shared"][i]
            # The first loader finds the 512-token prefix `store` saved; it saves the rest of
            # the shared prompts' full chunks, which the next loader finds too.
            want = 512 if mode == "async" else expected_kvd_tokens(len(p))
            assert got["num_cached_tokens"] == want, f"{mode} shared prefix {i}"
            assert_same_output(ref["shared"][i], got, f"{mode} load, shared prefix {i}")
