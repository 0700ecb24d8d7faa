"""A parallel engine run in its own process, for tests/parallel/test_parallel_engine.py (the test process
itself never joins a process group). Prints one JSON line `RESULT {...}` with what the test checks.

python engine_script.py MODE CHECKPOINT JSON_SETTINGS
  MODE generate: greedy + seeded generation of fixed prompts.
  MODE kill / hang: generation while a spawned rank is SIGKILLed / SIGSTOPped; reports the error and timings.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

PROMPTS = [[1, 2, 3, 4 + i] for i in range(6)] + [[7, 8, 9] * 6]


def run(mode: str, path: str, settings: dict) -> dict:
    from deepinfer import LLM, SamplingParams

    kw = dict(device="cpu", load_progress=False, max_model_len=128, dist_timeout_s=20.0)
    serve = settings.pop("serve", False)
    kw.update(settings)
    t0 = time.monotonic()
    llm = LLM(path, **kw)
    out: dict = {"start_s": time.monotonic() - t0}
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=1234)
    if mode == "generate":
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        out["greedy"] = [o.outputs[0].token_ids for o in outs]
        out["greedy_text"] = [o.outputs[0].text for o in outs]
        out["seeded"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
        # one request alone: it lands on the leader's replica, the others step with it (dummy forwards under EP)
        out["alone"] = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        if serve:
            out["served"] = serve_completions(llm)
        st = llm.stats()
        out["stats"] = {"prompt_tokens_total": st.prompt_tokens_total, "num_requests_finished": st.num_requests_finished,
                        "kv_blocks_total": st.kv_blocks_total, "local_kv_blocks_total": llm._local_stats().kv_blocks_total}
        out["rebalances"] = llm._leader.num_rebalances
        out["experts_moved"] = llm.experts_moved  # the leader's own layers
        llm.shutdown()
        return out
    child = llm._job.children[0][1]
    sig = signal.SIGKILL if mode == "kill" else signal.SIGSTOP
    threading.Timer(0.5, lambda: os.kill(child.pid, sig)).start()
    t1 = time.monotonic()
    try:
        for _ in range(200):
            llm.generate(PROMPTS, greedy, use_tqdm=False)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["error_after_s"] = time.monotonic() - t1
    if mode == "hang":
        try:
            os.kill(child.pid, signal.SIGCONT)
        except ProcessLookupError:  # already killed by the leader's stop
            pass
    time.sleep(0.5)
    out["children_alive"] = [p.is_alive() for _, p in llm._job.children]
    try:
        llm.generate(PROMPTS[:1], greedy, use_tqdm=False)
        out["later_call"] = "ran"
    except Exception as exc:  # noqa: BLE001
        out["later_call"] = f"{type(exc).__name__}: {exc}"
    return out


def serve_completions(llm) -> list[str]:
    """The OpenAI server on the leader: concurrent greedy completions through the official client."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
    from server_harness import start_server

    live = start_server(llm)
    try:
        client = openai.OpenAI(base_url=live.v1, api_key="none")

        def one(prompt):
            r = client.completions.create(model=llm.model_name, prompt=prompt, max_tokens=6, temperature=0.0)
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, PROMPTS[:4]))
    finally:
        live.stop()


if __name__ == "__main__":
    result = run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
