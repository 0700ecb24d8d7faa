"""RequestHandle.outputs() coalesces a lagging consumer's queue (outputs are cumulative) without letting a failure
swallow the progress queued before it: a stream's tokens from before an engine failure reach the client first.
(In CI under load the in-process server's consumer lagged a few engine steps behind, and the SSE stream of a
request failed after 2 tokens carried only the error event: tests/server/test_server_isolation.py.)"""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.entrypoints.openai.async_engine import EngineStepError, RequestFailedError, RequestHandle
from deepinfer.outputs import CompletionOutput, RequestOutput


class _NoEngine:
    def __init__(self):
        self.aborted = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _out(tokens: int, error: str | None = None, finished: bool = False) -> RequestOutput:
    reason = "error" if error else ("length" if finished else None)
    return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * tokens, list(range(tokens)), reason)],
                         finished=finished or error is not None, error=error)


def _drain(items) -> tuple[list[int], BaseException | None]:
    """Queue every item first (a consumer that lagged behind all of them), then iterate: the token counts
    yielded, and what was raised."""

    async def run():
        handle = RequestHandle("r", asyncio.Queue(), _NoEngine())
        for item in items:
            handle.queue.put_nowait(item)
        seen = []
        try:
            async for out in handle.outputs():
                seen.append(len(out.outputs[0].token_ids))
        except (RequestFailedError, EngineStepError) as exc:
            return seen, exc
        return seen, None

    return asyncio.run(run())


def test_progress_coalesces_to_the_newest():
    assert _drain([_out(1), _out(2), _out(3, finished=True)]) == ([3], None)


@pytest.mark.parametrize("failure", ["request", "step"])
def test_a_failure_does_not_swallow_the_tokens_before_it(failure):
    """[1 token, 2 tokens, failure]: the 2-token output is yielded, then the failure raises."""
    fail = _out(2, error="internal error in request 'r'") if failure == "request" else EngineStepError("boom")
    seen, exc = _drain([_out(1), _out(2), fail])
    assert seen == [2]
    assert isinstance(exc, RequestFailedError if failure == "request" else EngineStepError)


def test_a_failure_alone_raises_at_once():
    seen, exc = _drain([_out(0, error="internal error in request 'r'")])
    assert seen == [] and isinstance(exc, RequestFailedError)
