"""The offline API (`from llm_serving import LLM`) runs prompts through real agents and gives the
HTTP server's outputs for the same requests."""
from __future__ import annotations

import httpx

from llm_serving import LLM, SamplingParams
from tests.helpers import ServerProcess, tiny_config

PROMPTS = ["offline one", "a second, longer offline prompt", "3"]


def test_offline_generate_equals_http(tmp_path, tiny_model_dir):
    config = tiny_config(tmp_path, tiny_model_dir)
    with LLM(str(config)) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True), progress=False)
        [single] = llm.generate("offline one", SamplingParams(max_new_tokens=6, ignore_eos=True), progress=False)
    assert [o.prompt for o in outs] == PROMPTS and single.token_ids == outs[0].token_ids
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" and all(lp <= 0 for lp in o.logprobs)
               for o in outs)
    srv = ServerProcess(config)
    try:
        for prompt, out in zip(PROMPTS, outs):
            r = httpx.post(f"{srv.url}/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 6, "ignore_eos": True, "details": True}}, timeout=60).json()
            assert r["generated_text"] == out.text
            assert [t["id"] for t in r["details"]["tokens"]] == out.token_ids
    finally:
        srv.stop()
