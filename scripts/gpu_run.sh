#!/usr/bin/env bash
# One call on the GPU machine: build + check + time.
#   scripts/gpu_run.sh [STAGES]   STAGES: comma list of tests,check,kernels,bench,ab,profile,hf (default: all but ab and profile)
# Writes logs / JSON lines under $OUT (or ./gpu_out), prints a short summary last.
# Env: CKPT (default /tmp/ckpt-v2-lite), BATCHES (1,16,64,256), PROMPT (1024), OUTLEN (256), EAGER_TOO (0/1),
#      BENCH_ARGS (extra benchmarks.throughput arguments for bench and ab, e.g. --step-timing),
#      AB_ENVS ("ENV=1 ENV2=2;ENV=3 -- --async-scheduling off": ';'-separated settings, each env
#      assignments and optionally ' -- ' and extra throughput arguments). Stage mla: benchmarks.kernels_mla only
#      (KMLA_ARGS: its arguments); stage router: benchmarks.kernels --only router; TEST_PATHS: what stage
#      tests runs (default tests/nvidia + the async-scheduling GPU test).
#   ckpt: only make the v2-lite checkpoint at $CKPT (other stages wait for it; inv / quant / bench make it too).
#   The open issues' GPU measurements (each its own stage, none in the default set):
#      acc (issue 14: benchmarks.accuracy_bf16, ACC_PROMPTS=28), inv (issue 14, batch invariance: INV_PARTS of
#      tests (the GPU invariance tests), bench (benchmarks.batch_invariance on $CKPT, flag off vs on, prompt 512,
#      64 out, 16 prefill prompts), profile (the flag-on decode step at batch 1 and 64), sweep (the invariant
#      GEMM / MoE plan sweep), probe (benchmarks.invariant_tile_probe); default tests,bench,profile), spec (issue 17: benchmarks.speculative --device cuda on the embedded model,
#      SPEC_ARGS; SPEC_RUNS=N processes, SPEC_TRACE=1 plan traces), specbench (issue 17 at V2-Lite layer shapes: the
#      SB_PRESET checkpoint at SB_CKPT, SPECB_MODES, SPECB_SPLIT=1 a process a mode with off, SPECB_ARGS,
#      SPECB_RUNS, SPECB_KV_GIB), kvttft (issue 15: benchmarks.kv_tiers_ttft, V2-Lite shapes with KV_LAYERS layers at 8k),
#      moesweep (issue 18: benchmarks.moe_tile_sweep per MS_RUNS), quant (issue 18: benchmarks.quant_gemm, QG_ARGS e.g. "--sweep" or "--only moe"; device time from graph replays),
#      quante2e (issue 18: throughput bf16 on $CKPT, then QUANT_ARGS (default --quantization fp8) on QUANT_CKPT
#      (default $CKPT), then benchmarks.quant_summary's speed-up table (QUANT_BENCH_ARGS: throughput arguments for
#      both runs; with --prefill-profile the summary adds the prefill's Amdahl ceiling); QUANT_BASELINE=0 skips the bf16 run and
#      compares with the last one kept at /tmp/throughput_bf16.jsonl), int4ckpt (issue 18: writes INT4_CKPT,
#      default /tmp/ckpt-v2-lite-awq, from $CKPT with deepinfer.checkpoints.awq_writer, INT4_GROUP default 128),
#      int4b1 (issue 18, after int4ckpt: the CUDA int4 GEMVs' and GPTQ act-order experts' GPU tests,
#      benchmarks.int4_cuda_gemv (with the act-order experts' row), then decode at
#      batch 1, prompt 1024, 128 new tokens: bf16, then the AWQ copy with the CUDA GEMVs at
#      DEEPINFER_INT4_CUDA_SPLIT_K 1, 2 and 4 and with the Triton kernels, one machine; INT4B1_RUNS: a comma list of
#      bf16,int4_cuda_split1,int4_cuda_split2,int4_cuda_split4,int4_cuda_split8,int4_cuda_split4_w4
#      (_w4: DEEPINFER_INT4_CUDA_DENSE_WARPS=4, the others the default 8),int4_triton,gptq_act_order_sorted,
#      gptq_act_order_stored (the GPTQ act-order copy int4ckpt writes when INT4_ACT_ORDER_CKPT names it, read with
#      DEEPINFER_INT4_ACT_ORDER_SORT 1 / 0) keeps only those), int4prof (issue 18,
#      after int4ckpt: benchmarks.profile_step at batch 1 on $CKPT and the AWQ copy, then Nsight Compute's sections
#      of every CUDA int4 kernel, benchmarks.int4_cuda_gemv --ncu, into ncu_int4.txt), b1tiles (after int4ckpt:
#      benchmarks.b1_small_kernels' router and MLA merge + W_UV tile sweeps, then batch-1 decode of $CKPT and the
#      AWQ copy with the default tiles and the sweep's best, alternating: B1TILES_INT4 / B1TILES_BF16, default
#      'default best default best' / 'default best').
set -u
STAGES="${1:-tests,check,kernels,bench,hf}"
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
CKPT="${CKPT:-/tmp/ckpt-v2-lite}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEEPINFER_CACHE_DIR="${DEEPINFER_CACHE_DIR:-/tmp/deepinfer-cache}"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
log() { echo "[gpu_run $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

# the device's .git may be stale (its HEAD an old commit): the tree's content id (scripts/tree_id.sh) names the files
TREE_ID="$(bash scripts/tree_id.sh 2>/dev/null || echo unknown)"
export DEEPINFER_COMMIT="${DEEPINFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) tree $TREE_ID}"
log "commit ${DEEPINFER_COMMIT:-unknown} (tree id: scripts/tree_id.sh; the .git HEAD may be stale) stages=$STAGES"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || log "pip install -e . failed (PYTHONPATH used instead)"

# GPU clocks, power and throttle reasons every 250 ms while this script runs (smi.csv)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > "$OUT/smi.csv" 2>/dev/null &
SMI_PID=$!
trap 'kill $SMI_PID 2>/dev/null' EXIT
CK_PID=""
if (has bench || has hf || has profile || has ab || has ckpt || has inv || has quante2e || has int4ckpt || has int4b1 || has int4prof || has b1tiles) \
    && [ ! -f "$CKPT/config.json" ]; then
  log "making the v2-lite random checkpoint in the background -> $CKPT"
  ( python3 -m deepinfer.entrypoints.cli make-checkpoint --preset v2-lite --workers 8 "$CKPT" > /tmp/ckpt.log 2>&1 ) &
  CK_PID=$!
fi

# tests and the conformance check run side by side (both are small on the GPU) while the checkpoint is written
T_PID=""; C_PID=""
if has tests; then
  log "pytest tests/nvidia + the async-scheduling GPU test on the GPU"
  ( timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest ${TEST_PATHS:-tests/nvidia tests/engine/test_engine_async_scheduling_gpu.py} -q -p no:cacheprovider \
      > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log" ) &
  T_PID=$!
fi
if has check; then
  log "deepinfer check --device cuda --shapes real"
  ( timeout 300 python3 -m deepinfer.entrypoints.cli check --device cuda --shapes real > "$OUT/check.log" 2>&1;
    echo "rc=$?" >> "$OUT/check.log" ) &
  C_PID=$!
fi
INV_PARTS="${INV_PARTS:-tests,bench,profile}"
inv_has() { has inv && [[ ",$INV_PARTS," == *",$1,"* ]]; }
if [ -n "$T_PID" ]; then wait "$T_PID"; log "tests :: $(tail -2 "$OUT/tests.log" | tr '\n' ' ')"; fi
if [ -n "$C_PID" ]; then wait "$C_PID"; log "check :: $(tail -2 "$OUT/check.log" | tr '\n' ' ')"; fi
if has router; then
  timeout 120 python3 -m benchmarks.kernels --only router > "$OUT/kernels_router.log" 2>&1
  log "kernels --only router rc=$?"; grep -v '^{' "$OUT/kernels_router.log" | tail -40 | tee -a "$OUT/summary.txt"
fi
if has mla && ! has kernels; then
  timeout 240 python3 -m benchmarks.kernels_mla ${KMLA_ARGS:-} > "$OUT/kernels_mla.log" 2>&1
  log "kernels_mla rc=$?"; grep -v '^{' "$OUT/kernels_mla.log" | tail -40 | tee -a "$OUT/summary.txt"
fi
if has kernels; then
  log "kernel microbenchmarks"
  timeout 200 python3 -m benchmarks.kernels > "$OUT/kernels.log" 2>&1
  log "kernels rc=$?"; grep -v '^{' "$OUT/kernels.log" | tail -40 | tee -a "$OUT/summary.txt"
  timeout 120 python3 -m benchmarks.kernels_mla > "$OUT/kernels_mla.log" 2>&1  # MLA prep old/new + decode split sweep
  log "kernels_mla rc=$?"; grep -v '^{' "$OUT/kernels_mla.log" | tail -30 | tee -a "$OUT/summary.txt"
fi
if inv_has sweep; then  # (GPU only: runs while the checkpoint is written) the invariant GEMM's plans (tile x K split) at decode and prefill M, and the MoE's split
  log "issue 14: invariant GEMM / MoE plan sweep"
  timeout "${INV_SWEEP_TIMEOUT:-420}" python3 -m benchmarks.invariant_gemm_sweep --moe ${INV_SWEEP_ARGS:-} \
    --json-out "$OUT/invariant_sweep.jsonl" > "$OUT/invariant_sweep.log" 2>&1
  log "sweep rc=$?"; grep -v '^{' "$OUT/invariant_sweep.log" | tail -20 | tee -a "$OUT/summary.txt"
  grep -E '"moe"|cross_plan' "$OUT/invariant_sweep.log" | tee -a "$OUT/summary.txt"
fi
if inv_has probe; then  # whether a row's bits depend on the MMA tile (GEMM, MoE, MLA BLOCK_Q), and the tiles' times
  log "issue 14: invariant tile probe"
  timeout "${INV_PROBE_TIMEOUT:-420}" python3 -m benchmarks.invariant_tile_probe --json-out "$OUT/tile_probe.jsonl" \
    > "$OUT/tile_probe.log" 2>&1
  log "tile probe rc=$?"; grep -E 'same_bits|error' "$OUT/tile_probe.log" | tail -80 | tee -a "$OUT/summary.txt"
fi
INV_T_PID=""
if inv_has tests; then  # issue 14: the kernels at V2-Lite shapes + the engine needle test (after the sweep, whose timings it would disturb; beside the checkpoint's writing)
  log "issue 14: GPU batch-invariance tests"
  ( timeout "${INV_TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/nvidia/test_invariant_gpu.py \
      tests/engine/test_engine_batch_invariance_gpu.py > "$OUT/inv_tests.log" 2>&1; echo "rc=$?" >> "$OUT/inv_tests.log" ) &
  INV_T_PID=$!
fi
if [ -n "$CK_PID" ]; then wait "$CK_PID"; log "checkpoint rc=$? :: $(tail -1 /tmp/ckpt.log)"; fi
if has bench; then
  log "throughput (CUDA graphs)"
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.throughput "$CKPT" --batch-sizes "${BATCHES:-1,16,64,256}" \
    --prompt-len "${PROMPT:-1024}" --output-len "${OUTLEN:-256}" --output-len-small "${OUTLEN_SMALL:-${OUTLEN:-256}}" --json-out "$OUT/throughput.jsonl" \
    --accuracy-out /tmp/accuracy_tokens.json --profile-batch "${PROFILE_BATCH:-0}" ${BENCH_ARGS:-} > "$OUT/throughput.log" 2>&1
  log "throughput rc=$?"; grep -v '^{' "$OUT/throughput.log" | grep -v 'Loading weights' | tail -60 | tee -a "$OUT/summary.txt"
  if [ "${EAGER_TOO:-0}" = 1 ]; then
    timeout 200 python3 -m benchmarks.throughput "$CKPT" --batch-sizes "${EAGER_BATCHES:-1,64}" --prompt-len "${PROMPT:-1024}" \
      --output-len 64 --enforce-eager > "$OUT/throughput_eager.log" 2>&1
    log "eager rc=$?"; grep -v '^{' "$OUT/throughput_eager.log" | tail -6 | tee -a "$OUT/summary.txt"
  fi
fi
if has ab; then  # A/B of env settings at one batch size, each in its own engine (graphs are captured at start-up)
  IFS=';' read -ra AB_LIST <<< "${AB_ENVS:-}"
  for setting in "default" "${AB_LIST[@]}"; do
    [ "$setting" = "default" ] && envs="" || envs="$setting"
    args=""
    if [[ "$envs" == *" -- "* ]]; then args="${envs#* -- }"; envs="${envs%% -- *}"; fi
    [[ "$envs" == "--"* ]] && { args="${envs#--}"; envs=""; }
    log "A/B batch ${AB_BATCHES:-64}: ${setting}"
    env $envs timeout 200 python3 -m benchmarks.throughput "$CKPT" --batch-sizes "${AB_BATCHES:-64}" \
      --prompt-len "${PROMPT:-1024}" --output-len "${OUTLEN:-256}" --prefill-prompts 0 ${BENCH_ARGS:-} $args > /tmp/ab.log 2>&1
    log "  rc=$? :: $(grep -v '^{' /tmp/ab.log | grep -v Loading | grep -v step_timing | tail -1)"
    grep 'step_timing' /tmp/ab.log | tee -a "$OUT/summary.txt"
    cat /tmp/ab.log >> "$OUT/ab.log"
  done
fi
if has profile; then
  log "kernel profile of decode steps (torch.profiler)"
  timeout "${PROFILE_TIMEOUT:-240}" python3 -m benchmarks.profile_step "$CKPT" --batch-sizes "${PROFILE_BATCHES:-1,64,256}" \
    --trace-dir "$OUT" --json-out "$OUT/profile.jsonl" ${PROFILE_ARGS:-} > "$OUT/profile.log" 2>&1
  log "profile rc=$?"; grep -v '^{' "$OUT/profile.log" | grep -v 'Loading weights' | tail -120 | tee -a "$OUT/summary.txt"
fi
if has hf; then
  log "transformers baseline + teacher-forcing accuracy"
  ACC=""; [ -f /tmp/accuracy_tokens.json ] && ACC="--accuracy-in /tmp/accuracy_tokens.json"
  timeout "${HF_TIMEOUT:-240}" python3 -m benchmarks.hf_baseline "$CKPT" $ACC --batch-sizes "${HF_BATCHES:-1,16}" \
    --prompt-len "${PROMPT:-1024}" > "$OUT/hf.log" 2>&1
  log "hf rc=$?"; grep '^{' "$OUT/hf.log" | tail -5 | tee -a "$OUT/summary.txt"; tail -3 "$OUT/hf.log"
fi
if has acc; then
  log "issue 14: bf16 accuracy vs transformers (whole model, teacher-forced through fp32)"
  timeout "${ACC_TIMEOUT:-300}" python3 -m benchmarks.accuracy_bf16 --device nvidia --prompts "${ACC_PROMPTS:-28}" \
    --json-out "$OUT/accuracy_bf16.json" > "$OUT/accuracy_bf16.log" 2>&1
  log "accuracy_bf16 rc=$?"; tail -15 "$OUT/accuracy_bf16.log" | tee -a "$OUT/summary.txt"
fi
if has inv; then  # issue 14: INV_PARTS (comma list) of tests,bench,profile,sweep; default tests,bench,profile
  if [ -n "$INV_T_PID" ]; then  # started above, beside the checkpoint's writing
    wait "$INV_T_PID"
    log "inv tests :: $(tail -2 "$OUT/inv_tests.log" | tr '\n' ' ')"
    grep -E "^(FAILED|ERROR)" "$OUT/inv_tests.log" | head -20 | tee -a "$OUT/summary.txt"
  fi
  if inv_has bench; then
    log "issue 14: batch invariance on vs off"
    timeout "${INV_TIMEOUT:-420}" python3 -m benchmarks.batch_invariance "$CKPT" --batch-sizes "${INV_BATCHES:-1,64,256}" \
      --prompt-len "${INV_PROMPT:-512}" --output-len "${INV_OUTLEN:-64}" --prefill-prompts "${INV_PREFILL:-16}" ${INV_ARGS:-} \
      --json-out "$OUT/batch_invariance.jsonl" > "$OUT/batch_invariance.log" 2>&1
    log "batch_invariance rc=$?"; grep -v '^{' "$OUT/batch_invariance.log" | tail -20 | tee -a "$OUT/summary.txt"
  fi
  if inv_has profile; then  # where the invariant decode step's time goes (kernels by name, launches per step)
    log "issue 14: profile of the invariant decode step"
    DEEPINFER_BATCH_INVARIANT=1 timeout "${INV_PROFILE_TIMEOUT:-240}" python3 -m benchmarks.profile_step "$CKPT" \
      --batch-sizes "${INV_PROFILE_BATCHES:-1,64}" --steps 4 --trace-dir "$OUT" --json-out "$OUT/inv_profile.jsonl" \
      > "$OUT/inv_profile.log" 2>&1
    log "inv profile rc=$?"; grep -v '^{' "$OUT/inv_profile.log" | grep -v 'Loading weights' | tail -80 | tee -a "$OUT/summary.txt"
  fi
fi
if has spec; then
  # SPEC_RUNS=N: N processes one after another (each its own engines: independent samples of the adaptive plan),
  # speculative.log then speculative_r2.log ...; SPEC_TRACE=1 adds --plan-trace plan_trace[_rN].jsonl to each
  for run in $(seq 1 "${SPEC_RUNS:-1}"); do
    sfx=""; [ "$run" -gt 1 ] && sfx="_r$run"
    trace=""; [ "${SPEC_TRACE:-0}" = 1 ] && trace="--plan-trace $OUT/plan_trace$sfx.jsonl"
    log "issue 17: speculative decoding (embedded model, bf16), run $run"
    timeout "${SPEC_TIMEOUT:-400}" python3 -m benchmarks.speculative --device cuda \
      ${SPEC_ARGS:---concurrency 1 4 16 64 256 --modes off k1 k3 k5 adaptive --max-tokens 512 --repeats 3} $trace \
      > "$OUT/speculative$sfx.log" 2>&1
    log "speculative rc=$?"; grep -v '^{' "$OUT/speculative$sfx.log" | tail -30 | tee -a "$OUT/summary.txt"
  done
fi
if has specbench; then
  # issue 17 at V2-Lite layer shapes: the MTP benchmark checkpoint (deepinfer/checkpoints/presets_mtp_bench.py, drafts
  # accepted at a set rate, device-bound steps), one engine a mode with SPECB_KV_GIB of KV cache each
  # (SB_PRESET: v2-lite-mtp-bench, 8 layers, or v2-lite-mtp-bench-27l, V2-Lite's depth). SPECB_SPLIT=1: one process
  # a mode of SPECB_MODES, each with off (paired ratios per process; two engines of the 27-layer model fit a GPU)
  SB_PRESET="${SB_PRESET:-v2-lite-mtp-bench}"
  SB_CKPT="${SB_CKPT:-/tmp/ckpt-$SB_PRESET}"
  if [ ! -f "$SB_CKPT/config.json" ]; then
    log "making the $SB_PRESET checkpoint -> $SB_CKPT"
    python3 -m deepinfer.entrypoints.cli make-checkpoint --preset "$SB_PRESET" --workers 8 "$SB_CKPT" > /tmp/sbckpt.log 2>&1
    log "make-checkpoint rc=$?"
  fi
  SB_SETS="${SPECB_MODES:-off k1 k3 k5 adaptive}"
  if [ "${SPECB_SPLIT:-0}" = 1 ]; then SB_SETS="$(for m in ${SPECB_MODES:-k1 k3 k5 adaptive}; do printf 'off %s,' "$m"; done)"; fi
  IFS="," read -ra SB_LIST <<< "$SB_SETS"
  for run in $(seq 1 "${SPECB_RUNS:-1}"); do
    for modes in "${SB_LIST[@]}"; do
      sfx="_${modes// /_}"; [ "$run" -gt 1 ] && sfx="${sfx}_r$run"
      log "issue 17: speculative decoding at V2-Lite layer shapes ($SB_PRESET, bf16), modes $modes, run $run"
      timeout "${SPECB_TIMEOUT:-400}" python3 -m benchmarks.speculative --device cuda --model "$SB_CKPT" \
        --kv-cache-gib "${SPECB_KV_GIB:-2}" --modes $modes \
        ${SPECB_ARGS:---concurrency 1 4 16 64 --max-tokens 256 --repeats 3} > "$OUT/specbench$sfx.log" 2>&1
      log "specbench rc=$?"; grep -v '^{' "$OUT/specbench$sfx.log" | grep -v '^steps at\|^plan state\|Loading' | tail -24 \
        | tee -a "$OUT/summary.txt"
    done
  done
fi
if has kvttft; then
  log "issue 15: TTFT of a miss / device / host / disk hit at 8k"
  timeout "${KV_TIMEOUT:-400}" python3 -m benchmarks.kv_tiers_ttft ${KV_CKPT:---make v2-lite:${KV_LAYERS:-4}} --scratch /tmp/kvb \
    --device cuda --context "${KV_CONTEXT:-8192}" --reps "${KV_REPS:-3}" --workloads "${KV_WORKLOADS:-}" ${KV_ARGS:-} \
    > "$OUT/kv_tiers_ttft.log" 2>&1
  log "kv_tiers_ttft rc=$?"; grep -v '^{' "$OUT/kv_tiers_ttft.log" | tail -20 | tee -a "$OUT/summary.txt"
fi
if has quant; then
  log "issue 18: quantized GEMMs, device time (CUDA-graph replays) ${QG_ARGS:-}"
  timeout "${QG_TIMEOUT:-540}" python3 -m benchmarks.quant_gemm --json "$OUT/quant_gemm.jsonl" ${QG_ARGS:-} > "$OUT/quant_gemm.log" 2>&1
  log "quant_gemm rc=$?"; grep -v '^{' "$OUT/quant_gemm.log" | tail -70 | tee -a "$OUT/summary.txt"
fi
if has moesweep; then  # issue 18: MoE grouped-GEMM tiles per scheme; MS_RUNS: ';'-separated argument sets
  IFS=";" read -ra MS_SETS <<< "${MS_RUNS:---schemes fp8_w8a8 --aligned-tokens 256 --direct-tokens=;--schemes int4_awq --aligned-tokens= --direct-tokens 1}"
  i=0
  for set in "${MS_SETS[@]}"; do
    i=$((i+1)); log "issue 18: moe_tile_sweep $set"
    timeout "${MS_TIMEOUT:-300}" python3 -m benchmarks.moe_tile_sweep --json "$OUT/moe_sweep_$i.jsonl" $set > "$OUT/moe_sweep_$i.log" 2>&1
    log "moe_tile_sweep rc=$?"; grep -v '^{' "$OUT/moe_sweep_$i.log" | tail -30 | tee -a "$OUT/summary.txt"
  done
fi
if has int4ckpt; then
  INT4_CKPT="${INT4_CKPT:-/tmp/ckpt-v2-lite-awq}"
  if [ ! -f "$INT4_CKPT/config.json" ]; then
    log "issue 18: AWQ int4 copy of $CKPT (group ${INT4_GROUP:-128}) -> $INT4_CKPT"
    timeout "${INT4CKPT_TIMEOUT:-540}" python3 -m deepinfer.checkpoints.awq_writer "$CKPT" "$INT4_CKPT" --method awq \
      --group-size "${INT4_GROUP:-128}" --device cuda > "$OUT/awq_writer.log" 2>&1
    log "awq_writer rc=$? :: $(tail -1 "$OUT/awq_writer.log")"
  fi
  AO_CKPT="${INT4_ACT_ORDER_CKPT:-}"  # a GPTQ act-order copy too (the int4b1 runs gptq_act_order_*)
  if [ -n "$AO_CKPT" ] && [ ! -f "$AO_CKPT/config.json" ]; then
    log "issue 18: GPTQ act-order int4 copy of $CKPT (group ${INT4_GROUP:-128}) -> $AO_CKPT"
    timeout "${INT4CKPT_TIMEOUT:-540}" python3 -m deepinfer.checkpoints.awq_writer "$CKPT" "$AO_CKPT" --method gptq \
      --act-order --group-size "${INT4_GROUP:-128}" --device cuda > "$OUT/gptq_ao_writer.log" 2>&1
    log "awq_writer (gptq act-order) rc=$? :: $(tail -1 "$OUT/gptq_ao_writer.log")"
  fi
fi
if has int4b1; then
  log "issue 18: the CUDA int4 GEMVs (tests, kernel times, decode at batch 1)"
  timeout "${INT4B1_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider \
    ${INT4B1_TESTS:-tests/quant/test_int4_cuda_gemv.py tests/quant/test_int4_experts_act_order.py} > "$OUT/int4_cuda_tests.log" 2>&1
  log "int4 CUDA tests rc=$? :: $(tail -1 "$OUT/int4_cuda_tests.log")"
  timeout 300 python3 -m benchmarks.int4_cuda_gemv --json "$OUT/int4_cuda.jsonl" > "$OUT/int4_cuda.log" 2>&1
  log "int4_cuda_gemv rc=$?"; tail -20 "$OUT/int4_cuda.log" | tee -a "$OUT/summary.txt"
  B1="--batch-sizes 1 --prompt-len 1024 --output-len 128 --prefill-prompts 0 --max-num-batched-tokens 4096 --step-timing"
  I4="${INT4_CKPT:-/tmp/ckpt-v2-lite-awq}"
  AO="${INT4_ACT_ORDER_CKPT:-/tmp/ckpt-v2-lite-gptq-ao}"
  for run in "bf16 $CKPT 1 1 8" "int4_cuda_split1 $I4 1 1 8" "int4_cuda_split2 $I4 1 2 8" "int4_cuda_split4 $I4 1 4 8" \
             "int4_cuda_split8 $I4 1 8 8" "int4_cuda_split4_w4 $I4 1 4 4" "int4_triton $I4 0 1 8" \
             "gptq_act_order_sorted $AO 1 4 8 1" "gptq_act_order_stored $AO 1 4 8 0"; do
    read -r name ckpt cuda split warps sort <<< "$run"
    [[ -n "${INT4B1_RUNS:-}" && ",$INT4B1_RUNS," != *",$name,"* ]] && continue
    [[ "$name" == gptq_* && ! -f "$ckpt/config.json" ]] && continue  # (no act-order copy written)
    DEEPINFER_INT4_ACT_ORDER_SORT=${sort:-1} \
    DEEPINFER_INT4_CUDA_GEMV=$cuda DEEPINFER_INT4_CUDA_SPLIT_K=$split DEEPINFER_INT4_CUDA_DENSE_WARPS=$warps \
      timeout 200 python3 -m benchmarks.throughput \
      "$ckpt" $B1 --json-out "$OUT/b1_$name.jsonl" > "$OUT/b1_$name.log" 2>&1
    log "decode b1 $name rc=$?"; grep -v '^{' "$OUT/b1_$name.log" | grep -v Loading | grep -v step_timing | tail -2 \
      | tee -a "$OUT/summary.txt"
  done
fi
if has b1tiles; then  # the batch-1 step's small kernels (router, MLA merge + W_UV): tile sweeps, then the step A/B
  log "batch-1 small kernels: tile sweeps (benchmarks.b1_small_kernels)"
  timeout 300 python3 -m benchmarks.b1_small_kernels --json "$OUT/b1_tiles.jsonl" > "$OUT/b1_tiles.log" 2>&1
  log "b1_small_kernels rc=$?"; grep -v '^{' "$OUT/b1_tiles.log" | tail -8 | tee -a "$OUT/summary.txt"
  BEST_ENVS="$(grep '^best: ' "$OUT/b1_tiles.log" | sed 's/^best: //' | tr '\n' ' ')"
  B1="--batch-sizes 1 --prompt-len 1024 --output-len 128 --prefill-prompts 0 --max-num-batched-tokens 4096"
  for run in "int4 ${INT4_CKPT:-/tmp/ckpt-v2-lite-awq} ${B1TILES_INT4:-default best default best}" \
             "bf16 $CKPT ${B1TILES_BF16:-default best}"; do
    read -r name ckpt order <<< "$run"
    for tiles in $order; do  # alternating (a drift shows as a trend)
      envs=""; [ "$tiles" = best ] && envs="$BEST_ENVS"
      env $envs timeout 200 python3 -m benchmarks.throughput "$ckpt" $B1 --json-out "$OUT/b1tiles_$name.jsonl" \
        > /tmp/b1t.log 2>&1
      log "decode b1 $name tiles=$tiles ($envs) rc=$? :: $(grep -v '^{' /tmp/b1t.log | grep -v Loading | tail -1)"
    done
  done
fi
if has int4prof; then  # issue 18: where the int4 batch-1 step goes (after int4ckpt): kernels by name, then ncu
  log "issue 18: profile of the batch-1 decode step, bf16 and AWQ int4 (CUDA GEMVs)"
  for run in "bf16 $CKPT" "int4 ${INT4_CKPT:-/tmp/ckpt-v2-lite-awq}"; do
    read -r name ckpt <<< "$run"
    timeout 240 python3 -m benchmarks.profile_step "$ckpt" --batch-sizes 1 --steps 5 \
      --json-out "$OUT/profile_b1_$name.jsonl" > "$OUT/profile_b1_$name.log" 2>&1
    log "profile b1 $name rc=$?"; grep -v '^{' "$OUT/profile_b1_$name.log" | grep -v 'Loading weights' | tail -45 \
      | tee -a "$OUT/summary.txt"
  done
  NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  log "ncu of the CUDA int4 kernels ($NCU)"
  timeout 300 "$NCU" --clock-control none --kernel-name regex:int4_ --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    python3 -m benchmarks.int4_cuda_gemv --ncu > "$OUT/ncu_int4.txt" 2>&1
  log "ncu rc=$? ($(grep -c 'int4_' "$OUT/ncu_int4.txt") kernel lines)"
  grep -E 'int4_|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit Reg|Waves Per SM|Stall Long|Warp Cycles Per Issued|Issued Warp|No Eligible' \
    "$OUT/ncu_int4.txt" | head -200 | tee -a "$OUT/summary.txt"
fi
if has quante2e; then
  QUANT_CKPT="${QUANT_CKPT:-$CKPT}"
  if [ "${QUANT_BASELINE:-1}" = 1 ]; then
    log "issue 18: throughput bf16 on $CKPT (the baseline of the quantized run)"
    timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.throughput "$CKPT" --batch-sizes "${BATCHES:-1,64,256}" \
      --prompt-len "${PROMPT:-1024}" --output-len "${OUTLEN:-256}" ${QUANT_BENCH_ARGS:-} --json-out /tmp/throughput_bf16.jsonl \
      > "$OUT/throughput_bf16.log" 2>&1
    log "throughput bf16 rc=$?"; grep -v '^{' "$OUT/throughput_bf16.log" | grep -v Loading | tail -8 | tee -a "$OUT/summary.txt"
    cp /tmp/throughput_bf16.jsonl "$OUT/" 2>/dev/null
  fi
  log "issue 18: throughput on $QUANT_CKPT with '${QUANT_ARGS---quantization fp8}'"
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.throughput "$QUANT_CKPT" --batch-sizes "${BATCHES:-1,64,256}" \
    --prompt-len "${PROMPT:-1024}" --output-len "${OUTLEN:-256}" ${QUANT_BENCH_ARGS:-} ${QUANT_ARGS---quantization fp8} \
    --json-out "$OUT/throughput_quant.jsonl" > "$OUT/throughput_quant.log" 2>&1
  log "throughput (quantized) rc=$?"; grep -v '^{' "$OUT/throughput_quant.log" | grep -v Loading | tail -8 | tee -a "$OUT/summary.txt"
  python3 -m benchmarks.quant_summary /tmp/throughput_bf16.jsonl "$OUT/throughput_quant.jsonl" 2>&1 | grep -v '^{' | tee -a "$OUT/summary.txt"
fi
log "done"
# the device sends back at most 8 files from $OUT: past that, all but summary.txt travel in one bundle.tgz
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  log "packing $(find "$OUT" -type f | wc -l) files into bundle.tgz (tar xzf it; the device sends back at most 8 files)"
  kill $SMI_PID 2>/dev/null; sleep 0.3
  bash scripts/pack_out.sh "$OUT" 8 > /dev/null
fi
