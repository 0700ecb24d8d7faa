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
    max_tokens = settings.pop("max_tokens", 6)
    kw.update(settings)
    t0 = time.monotonic()
    llm = LLM(path, **kw)
    out: dict = {"start_s": time.monotonic() - t0}
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seeded = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=1234)
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
                        "kv_blocks_total": st.kv_blocks_total, "local_kv_blocks_total": llm._local_stats().kv_blocks_total,
                        "spec_drafted_tokens": st.spec_drafted_tokens, "spec_accepted_tokens": st.spec_accepted_tokens}
        out["rebalances"] = llm._leader.num_rebalances
        cpf = getattr(llm, "runner", None) and llm.runner.context_parallel  # the leader's cp forward, if any
        out["cp_split_steps"] = cpf.num_split_steps if cpf else 0
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


# ------------------------------------------------------------ review scenarios (tests/parallel/test_parallel_review.py)


def _faulty_engine_class():
    """The leader's engine with one injected failure of its own replica's step, after the step command went out
    (what a leader-only DeepInferError in a step, e.g. "scheduler made no progress", does). A subclass used by
    the leader only: the followers build the ordinary engine."""
    from deepinfer import LLM
    from deepinfer.errors import DeepInferError

    class FaultyLeader(LLM):
        fail_next_local_step = False

        def _local_step(self, all_outputs):
            if self.fail_next_local_step:
                self.fail_next_local_step = False
                raise DeepInferError("injected: the leader's replica failed its step")
            return super()._local_step(all_outputs)

    return FaultyLeader


def _call(fn) -> str:
    try:
        return repr(fn())
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"


def review(path: str, settings: dict) -> dict:
    """DP=2 (one request per replica placed by the router): API parity with one process, then a leader-only
    failure after the broadcast."""
    from deepinfer import SamplingParams

    kw = {"device": "cpu", "load_progress": False, "max_model_len": 128, "dist_timeout_s": 10.0}
    kw.update(settings)
    llm = _faulty_engine_class()(path, **kw)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    out: dict = {}
    # generate() while a request from add_request is unfinished on the other replica (one process: refused)
    llm.add_request("a", PROMPTS[0], greedy)  # replica 0 (ties go to the lowest)
    llm.add_request("b", PROMPTS[1], greedy)  # replica 1
    llm.abort_request("a")
    out["generate_with_remote_pending"] = _call(lambda: len(llm.generate(PROMPTS[:1], greedy, use_tqdm=False)))
    seen_b = False
    for _ in range(12):
        seen_b |= any(o.request_id == "b" and o.finished for o in llm.step())
        if not llm.has_unfinished_requests():
            break
    out["b_finished_output_seen"] = seen_b
    # abort of a request on the other replica: its last state, as one process returns it
    llm.add_request("x", PROMPTS[2], greedy)  # replica 0
    llm.add_request("c", PROMPTS[3], greedy)  # replica 1
    llm.step()
    got = llm.abort_request("c")
    out["remote_abort_finish_reason"] = None if got is None else got.outputs[0].finish_reason
    llm.abort_request("x")
    out["unfinished_after_aborts"] = llm.has_unfinished_requests()
    for _ in range(4):
        if not llm.has_unfinished_requests():
            break
        llm.step()
    # a failure on the leader after the step command went out: every rank must stop, no later collective
    llm.add_request("e", PROMPTS[4], greedy)  # replica 0
    llm.add_request("d", PROMPTS[5], greedy)  # replica 1
    llm.fail_next_local_step = True
    t0 = time.monotonic()
    out["fault"] = _call(llm.step)
    out["fault_s"] = time.monotonic() - t0
    time.sleep(0.5)
    out["children_alive_after_fault"] = [p.is_alive() for _, p in llm._job.children]
    out["unfinished_after_fault"] = _call(llm.has_unfinished_requests)
    t0 = time.monotonic()
    out["later_step"] = _call(llm.step)
    out["later_step_s"] = time.monotonic() - t0
    llm.shutdown()
    return out


def kill_at_start(path: str, settings: dict) -> dict:
    """A spawned rank killed before it reaches the rendezvous: the leader's start-up must end with an error
    naming it, not wait out the start-up timeout."""
    import multiprocessing

    from deepinfer import LLM

    stop = threading.Event()
    killed_at: list[float] = []

    def killer():
        while not stop.is_set():
            for p in multiprocessing.active_children():
                if p.name.startswith("deepinfer-rank"):
                    os.kill(p.pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    return
            time.sleep(0.005)

    threading.Thread(target=killer, daemon=True).start()
    kw = {"device": "cpu", "load_progress": False, "max_model_len": 128, "dist_timeout_s": 10.0}
    kw.update(settings)
    out: dict = {"error": _call(lambda: LLM(path, **kw) and "started")}
    out["error_after_kill_s"] = time.monotonic() - killed_at[0] if killed_at else None
    stop.set()
    return out


def idle_hang(path: str, settings: dict) -> dict:
    """A rank SIGSTOPped while the leader is idle: the heartbeat finds it; the hung rank is stopped, not left
    holding its device until shutdown, and shutdown is prompt."""
    from deepinfer import LLM, SamplingParams

    kw = {"device": "cpu", "load_progress": False, "max_model_len": 128, "dist_timeout_s": 2.0}
    kw.update(settings)
    llm = LLM(path, **kw)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    child = llm._job.children[0][1]
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 15.0
    while llm._leader._broken is None and time.monotonic() < deadline:
        time.sleep(0.1)
    out: dict = {"broken": llm._leader._broken}
    time.sleep(0.5)
    out["child_alive_before_shutdown"] = child.is_alive()
    t0 = time.monotonic()
    llm.shutdown()
    out["shutdown_s"] = time.monotonic() - t0
    try:
        os.kill(child.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    out["child_alive_after_shutdown"] = child.is_alive()
    return out


REVIEW_MODES = {"review": review, "kill_at_start": kill_at_start, "idle_hang": idle_hang}


if __name__ == "__main__":
    if sys.argv[1] in REVIEW_MODES:
        result = REVIEW_MODES[sys.argv[1]](sys.argv[2], json.loads(sys.argv[3]))
        print("RESULT " + json.dumps(result), flush=True)
        sys.exit(0)
    result = run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
