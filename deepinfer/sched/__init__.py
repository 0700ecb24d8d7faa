"""The scheduling room: requests and sequences, the continuous-batching scheduler, the step pipeline.

`request.py` (Request, Sequence), `scheduler.py` (token budget, chunked prefill, preemption),
`step_pipeline.py` (schedule -> launch -> resolve, async scheduling).
"""
