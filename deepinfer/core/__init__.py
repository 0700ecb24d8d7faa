"""Device-agnostic core: backend contract, KV cache, scheduler, sampler, runner, native ops."""
