"""benchmarks.triton_compiles.CompileLog: Triton's JIT hooks, called as Triton calls them (keyword arguments; the
constexprs keyed by argument index paths), are recorded with the kernel, its constexprs by name and the time between
the two hooks; hooks installed before it still run and are put back on exit."""

import time
from types import SimpleNamespace

from triton import knobs

from benchmarks.triton_compiles import CompileLog


def _call(hook, name, key, constants):
    fn = SimpleNamespace(name=name, jit_function=SimpleNamespace(arg_names=["x_ptr", "N", "BLOCK_M", "ACT"]))
    return hook(key=key, repr=name, fn=fn, compile={"key": key, "constants": constants}, is_manual_warmup=False,
                already_compiled=False)


def test_records_compiles_and_chains_hooks():
    seen = []
    rt = knobs.runtime
    outer = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    rt.jit_cache_hook = lambda **kw: seen.append(("before", kw["fn"].name))
    rt.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["fn"].name))
    try:
        installed = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        with CompileLog() as log:
            _call(rt.jit_cache_hook, "_moe_kernel", "k1", {(2,): 128, (3,): "bf16"})
            time.sleep(0.02)
            _call(rt.jit_post_compile_hook, "_moe_kernel", "k1", {(2,): 128, (3,): "bf16"})
        assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == installed  # put back
        assert seen == [("before", "_moe_kernel"), ("after", "_moe_kernel")]  # the earlier hooks still ran
        [c] = log.compiles
        assert c.kernel == "_moe_kernel" and c.constants == "BLOCK_M=128, ACT=bf16" and c.seconds >= 0.02
        assert "1 Triton compiles" in log.describe() and "_moe_kernel" in log.describe()
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = outer
    assert CompileLog().describe() == "no Triton compiles"
