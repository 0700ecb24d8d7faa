"""Run as a subprocess with the fake torch_npu on PYTHONPATH: greedy generation of tiny V3-family presets
on the ascend backend (eager, then with decode graphs: enforce_eager off, buckets up to max_num_seqs 4)
and on the cpu backend; prints {preset: [ascend eager, ascend graphs, cpu, graph replays]} as JSON.

"tiny-v3-ascend-mla" is tiny-v3 with MLA at DeepSeek's real head widths (kv_lora_rank 512, rope 64,
nope / v 128, 2 heads), the only shapes npu_fused_infer_attention_score's MLA modes take, so the fused
attention path runs end to end; the stock tiny presets run MLA natively on ascend (op_impl says so).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile

import torch_npu  # the test-only fake (this script runs with it on PYTHONPATH): its graph replay count

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoints import PRESETS, make_checkpoint
from deepinfer.checkpoints.presets import register_preset


def main(presets: list[str]) -> None:
    base = PRESETS["tiny-v3"]
    cfg = dict(base.config, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2)
    register_preset(dataclasses.replace(base, name="tiny-v3-ascend-mla", config=cfg))
    prompts = [[5, 17, 300, 42, 9, 77, 8, 12, 600, 3, 2, 99, 41], [7, 8, 9, 10, 11, 1000]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            path = f"{tmp}/{preset}"
            make_checkpoint(preset, path, seed=0, progress=False)
            tokens, replays = [], 0
            for device, eager in (("ascend", True), ("ascend", False), ("cpu", True)):
                llm = LLM(model=path, device=device, dtype="float16", max_model_len=64, num_kv_blocks=8,
                          block_size=16, load_progress=False, enforce_eager=eager, max_num_seqs=4)
                before = torch_npu.npu.EVENTS.count("replay")
                tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
                replays += torch_npu.npu.EVENTS.count("replay") - before
            result[preset] = tokens + [replays]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
