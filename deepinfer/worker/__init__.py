"""The worker room: turns a scheduled step into device work and reads the draw back.

`model_runner.py` (ModelRunner: launch / resolve a step, decode-graph replay through the
backend's graph runner), `batch_builder.py` (SchedulerOutput -> ForwardBatch), `transfer.py`
(host <-> device copies that never sync the stream), `step_timer.py` (per-phase timing),
`profile_run.py` (the memory-profiling forward before the KV cache is sized).
"""
