#!/usr/bin/env bash
# Runs on the H200 test machine (device tool): installs this tree without network, then the issue-3 benchmarks.
#   bash evals/scripts/h200_issue3.sh COMMIT PART...
#   PART: machine | warm-experts | q16-rows (ROUNDS) | dots-prefetch (ROUNDS) | d1-caller-ab (FORMATS, BUDGETS, WARMUP) | act-vector | tile-pairs | dequant-prefetch | dots-in-cache | attn-ab (ATTN_FILES) | attn-sweep | kernel-launch | kernel-paths | contention | block-tests | d1-blocks (TOKENS, BUDGETS, STRATEGIES, SHARES) | profile-blocks | kernel-phases | speculative (SPEC_FORMAT) | speculative-tests | serve-hybrid | reuse-ab (FORMATS, ARMS, EDITS, REUSE_S, SKEW, REUSE_ARGS) | profile-turn (TURN_AB, TURN_STORE) | turn-trace (TRACE_PATHS) | kernel-streams (ROUNDS) | v4-ab | d1-families (FAMILIES, FAMILY_S, WARMUP, TOKENS, BUDGETS) | copy-batch-check | d1-final | d1-bias-long | d1-ab-long (B_ENV, BUDGETS, WARMUP, CONTEXT) | profile-cache | wake-bench | copy-size-cost | profile-perf | d1-1k | d1-16k-q8 | profile-host2 | kernel-diag | d1-matrix1 | d1-dispatch-ab | d1-cpu-first-abab | d1-now | d1-guard | d1-matrix | d1-cpu-first-ab | profile-host | gptoss-tests | d1-gptoss20b | d1-gptoss20b-early | d1-gptoss120b | families-tests | graphs-batch-tests | d1-qwen35 | d1-qwen3next | d1-glm5 | d1-glm45air | d1-deepseekv3 | p1-8l | profile-prefill | profile-decode | decode-ab | attn | p1-ahead | d1-16k-ab | tests | batching-cuda | reuse | reuse-resident | kernel-prefill | serve-bench | serve-profile | serve-bench-resident | serve-emit-ab | graphs-test | q8-tests | profile-q8 | d1-main | d1-ab | p1-ab | p1-main | kernel | kernel-pinned | diag | profile | d1-bf16 | d1-q8 | d1-q8-nographs | copier-cost | d1-16k | p1 | hf
# The gguf wheel travels in .carry/whl (the machine has no gguf package); serve-bench also needs .carry/tok
# (SmolLM2's tokenizer as a tensor-less GGUF: evals/scripts/tokenizer_gguf.py) and .carry/srv (the server's wheels the
# machine lacks: pip download --only-binary=:all: --python-version 3.12 fastapi uvicorn openai anthropic, minus the
# ones it has). Results land in $OUT.
set -uo pipefail
commit=$1; shift
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .carry/whl/*.whl \
  $(ls .carry/srv/*.whl 2>/dev/null) . \
  >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH FREETOKEN_HOME=/tmp/ft
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    machine) nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node|cache"; free -g | head -2
             nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv ;;
    graphs-test) (cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$OLDPWD" \
             -k test_on_cuda_pinned "$OLDPWD/tests/engine/offload/test_offloaded_executor.py" 2>&1 | tail -3 \
             | tee -a "$OUT/tests.txt") ;;
    reuse) ft bench reuse --shape qwen3-30b-a3b --history 20000 --turn 500 --edits 1000,4000,16000 \
             --expert-cache 16GiB --commit "$commit" --out "$OUT/reuse-qwen3-30b-a3b-20k.md" ;;
    # issue 5 under offload: the default against each experimental path of ARMS ("default" = none named), per
    # expert format (FORMATS), one build each
    reuse-ab) for f in ${FORMATS:-dense Q8_0}; do for x in ${ARMS:-default ahead-batches}; do
             FREETOKEN_EXPERIMENTAL=${x#default} timeout ${REUSE_S:-200} ft bench reuse --shape qwen3-30b-a3b --skew ${SKEW:-0} \
               --history 20000 --turn 500 --edits ${EDITS:-1000,4000,16000} --expert-cache 16GiB --expert-format $f \
               --turn-paths "" ${REUSE_ARGS:-} --commit "$commit $x" --out "$OUT/reuse-20k-16gib-skew${SKEW:-0}-$f-$x.md" 2>&1 \
               | grep -E "^\| (cold|reuse|edit)|^prefill planner" ; done; done ;;
    # issue 5's turn under offload, the host thread's phases per layer (evals/scripts/profile_turn.py): without and
    # with the block store (TURN_STORE: "off block-store", either or both), each A/B against TURN_AB (run-time GPU paths)
    profile-turn) for x in ${TURN_STORE:-off block-store}; do x=${x#off}; (cd /tmp && FREETOKEN_EXPERIMENTAL=$x python3 \
               "$OLDPWD/evals/scripts/profile_turn.py" --ab ${TURN_AB:-short-chunks-cpu ahead-wide short-chunks-cpu,ahead-wide} 2>&1 | grep -v Warning \
               | sed "1i == block store ${x:-off}" | tee -a "$OUT/profile-turn.txt"); done ;;
    # one turn's GPU timeline (profile_turn.py --trace, then turn_timeline.py): FREETOKEN_EXPERIMENTAL=TRACE_PATHS
    turn-trace) (cd /tmp && FREETOKEN_EXPERIMENTAL=${TRACE_PATHS:-block-store} python3 "$OLDPWD/evals/scripts/profile_turn.py" \
               --repeats 2 --trace "$OUT/turn-trace.json.gz" 2>&1 | grep -E "^== turn|^per turn" | tee -a "$OUT/turn-timeline.md"
             python3 "$OLDPWD/evals/scripts/turn_timeline.py" "$OUT/turn-trace.json.gz" | tee -a "$OUT/turn-timeline.md") ;;
    reuse-resident) ft bench reuse --shape qwen3-30b-a3b --history 20000 --turn 500 --edits 1000,4000,16000 \
             --commit "$commit" --out "$OUT/reuse-qwen3-30b-a3b-20k-resident.md" ;;
    # where a kernel call's time goes per tokens per expert (the 32-token cliff): 15 threads, buffers fresh and
    # preallocated, and one thread
    kernel-phases) for args in "--threads 15" "--threads 15 --preallocated" "--threads 1 --batches 16 32 --experts 8"; do
             (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_phases.py" $args | tee -a "$OUT/kernel-phases.txt"); done ;;
    # speculative decoding with an MTP layer (forced acceptance): GLM-4.5-Air's and Qwen3.5-35B-A3B's shapes (SPEC_SHAPES),
    # 8 layers, resident and offloaded
    speculative) for shape in ${SPEC_SHAPES:-glm-4.5-air qwen3.5-35b-a3b}; do
               ft bench speculative --shape $shape --layers 8 --budgets all,0,2GiB --acceptance 0,0.5,0.8,0.9,1 \
               --tokens 64 --expert-format ${SPEC_FORMAT:-dense} --commit "$commit" \
               --out "$OUT/speculative-$shape-8l-${SPEC_FORMAT:-dense}.md"; done ;;
    # the block store (quantized experts in their block format on the device): its CUDA tests, then D1 Q8_0 with
    # shares 0 (every cached expert dequantized) and 1 (all in block format) at 8 and 16 GiB, one build
    block-tests) (cd /tmp && python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -rf \
             "$OLDPWD/tests/engine/offload/test_block_store.py" "$OLDPWD/tests/engine/offload/test_quantized_experts.py" \
             "$OLDPWD/tests/kernels/test_gguf_dequant_fused.py" "$OLDPWD/tests/engine/offload/test_stream_early.py" \
             "$OLDPWD/tests/engine/offload/test_staging_ring.py" 2>&1 | tail -15 | tee -a "$OUT/tests.txt") ;;
    d1-blocks) ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens ${TOKENS:-16} --budgets ${BUDGETS:-8GiB,16GiB} \
             --expert-format Q8_0 --strategies ${STRATEGIES:-resident-graphs,copy,auto} --block-shares ${SHARES:-0,1} \
             --commit "$commit" --out "$OUT/d1-q8-1k-blocks.md" 2>&1 | grep -v -e Warning -e "latest windows" \
             | tee -a "$OUT/d1-blocks.log" | grep -E "^\| (copy|auto|res)" ;;
    # the host's time per decode layer-step without and with the block store (D1 Q8_0, 16 GiB, auto, perf clock)
    profile-blocks) for x in "" block-store; do (cd /tmp && FREETOKEN_EXPERIMENTAL=$x python3 \
               "$OLDPWD/evals/scripts/profile_offload.py" --layers 48 --budget 16GiB --strategy auto --expert-format Q8_0 \
               --clock perf --tokens 16 --warmup 16 --out /tmp/prof 2>&1 | grep -v Warning | tail -40 \
               | sed "1i == block store ${x:-off}" | tee -a "$OUT/profile-blocks.txt"); done ;;
    speculative-tests) (cd /tmp && python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -rf \
             "$OLDPWD/tests/engine/test_speculative.py" 2>&1 | tail -15 | tee -a "$OUT/tests.txt") ;;
    kernel-prefill) (cd /tmp && FREETOKEN_CPU_THREADS=15 python3 -m freetoken.kernels.cpu_experts.bench \
             --batches 1 8 16 32 64 | tee "$OUT/cpu-kernel-prefill-batches.txt") ;;
    serve-profile) export FREETOKEN_DEFAULT_MODEL=$PWD/.carry/tok/smollm2-tokenizer.gguf
             [ -f /tmp/q3-8l.gguf ] || ft bench export --shape qwen3-30b-a3b --layers 8 --format gguf-q8_0 \
               --out /tmp/q3-8l.gguf | tail -1
             for b in 4 16; do (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_batch.py" --model /tmp/q3-8l.gguf \
               --batch $b 2>&1 | tee "$OUT/profile-batch-$b.txt" | head -40); done ;;
    serve-bench) export FREETOKEN_DEFAULT_MODEL=$PWD/.carry/tok/smollm2-tokenizer.gguf  # tokenizer-only GGUF
             ft bench export --shape qwen3-30b-a3b --layers 8 --format gguf-q8_0 --out /tmp/q3-8l.gguf | tail -1
             ft bench serve --model /tmp/q3-8l.gguf --sessions 1,4,16 --tokens 64 --commit "$commit" \
               --out "$OUT/serve-q3-8l-resident.md"
             ft bench serve --model /tmp/q3-8l.gguf --expert-cache 1GiB --sessions 1,4,16 --tokens 64 \
               --commit "$commit" --out "$OUT/serve-q3-8l-offloaded.md" ;;
    # concurrent sessions of a model with recurrent layers (batched since 08edb0e): Qwen3-Next, 8 layers, resident
    serve-hybrid) export FREETOKEN_DEFAULT_MODEL=$PWD/.carry/tok/smollm2-tokenizer.gguf  # tokenizer-only GGUF
             ft bench export --shape qwen3-next-80b-a3b --layers 8 --format safetensors --out /tmp/qn-8l | tail -1
             ft bench serve --model /tmp/qn-8l --sessions 1,4,16 --tokens 64 --commit "$commit" \
               --out "$OUT/serve-qwen3-next-8l-resident.md" ;;
    serve-emit-ab) export FREETOKEN_DEFAULT_MODEL=$PWD/.carry/tok/smollm2-tokenizer.gguf  # emit-after-launch on/off
             [ -f /tmp/q3-8l.gguf ] || ft bench export --shape qwen3-30b-a3b --layers 8 --format gguf-q8_0 \
               --out /tmp/q3-8l.gguf | tail -1
             for x in "" emit-after-launch; do FREETOKEN_DISABLE=$x ft bench serve --model /tmp/q3-8l.gguf \
               --sessions 1,4,16 --tokens 64 --repeats 5 --commit "$commit${x:+ -$x}" \
               --out "$OUT/serve-q3-8l-resident${x:+-no-$x}.md" | grep -E "^\| (in-process|server|1|4|16) "; done ;;
    serve-bench-resident) export FREETOKEN_DEFAULT_MODEL=$PWD/.carry/tok/smollm2-tokenizer.gguf
             ft bench export --shape qwen3-30b-a3b --layers 8 --format gguf-q8_0 --out /tmp/q3-8l.gguf | tail -1
             ft bench serve --model /tmp/q3-8l.gguf --sessions 1,2,4,8,16 --tokens 64 --commit "$commit" \
               --out "$OUT/serve-q3-8l-resident.md" ;;
    graphs-batch-tests) (cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$OLDPWD" -k cuda -rf \
             "$OLDPWD/tests/engine/test_batching.py" "$OLDPWD/tests/engine/test_static_decode.py" \
             "$OLDPWD/tests/engine/models/test_glm_moe_dsa.py" "$OLDPWD/tests/kernels/test_paged_decode.py" 2>&1 | tail -25 \
             | tee -a "$OUT/tests.txt") ;;
    batching-cuda) (cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$OLDPWD" -k cuda \
             "$OLDPWD/tests/engine/test_batching.py" "$OLDPWD/tests/sdk/test_sessions.py" 2>&1 | tail -15) ;;
    q8-tests) (cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$OLDPWD" -k "cuda or compiled" \
             "$OLDPWD/tests/kernels/test_gguf_dequant_fused.py" "$OLDPWD/tests/engine/offload/test_quantized_experts.py" \
             2>&1 | grep -vE "^\s*$" | tail -45) ;;
    d1-main) ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,8GiB,16GiB \
               --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-bf16-1k.md" ;;
    profile-prefill) for g in grouped-mm ""; do (cd /tmp && FREETOKEN_DISABLE=$g python3 \
             "$OLDPWD/evals/scripts/profile_resident.py" --layers 8 --tokens 16384 2>&1 | grep -v "expert cache" \
             | tee "$OUT/profile-prefill-16k${g:+-no-$g}.txt"); done ;;
    decode-ab) for g in paged-decode ""; do FREETOKEN_DISABLE=$g ft bench decode --shape qwen3-30b-a3b \
             --layers 8 --context 16384 --tokens 16 --budgets 0 --strategies resident-graphs,copy,auto \
             --commit "$commit (FREETOKEN_DISABLE=$g)" --out "$OUT/d1-8l-16k${g:+-no-$g}.md"; done
             (cd /tmp && python3 -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" \
               "$OLDPWD/tests/kernels/test_paged_decode.py" 2>&1 | tail -2
              python3 -m freetoken.kernels.paged_decode.bench | tee "$OUT/paged-decode-kernel.md") ;;
    profile-decode) for t in 1024 16384; do (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_resident.py" --layers 8 \
             --tokens $t --decode 16 2>&1 | grep -v "expert cache" | tee "$OUT/profile-decode-$t.txt"); done ;;
    p1-8l) for g in grouped-mm ""; do FREETOKEN_DISABLE=$g ft bench prefill --shape qwen3-30b-a3b --layers 8 \
             --prompts 4096,16384 --chunk 16384 --budgets 0 --strategies resident,copy,copy-ahead --repeats 3 \
             --commit "$commit (FREETOKEN_DISABLE=$g)" --out "$OUT/p1-8l${g:+-no-$g}.md"; done ;;
    attn) (cd /tmp && python3 -m freetoken.kernels.paged_decode.bench --batches 4 16 | tee "$OUT/decode-attention.md") ;;
    families-tests) (cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$OLDPWD" \
             "$OLDPWD/tests/kernels/test_gated_delta.py" "$OLDPWD/tests/engine/models/test_qwen3_next.py" \
             "$OLDPWD/tests/engine/models/test_grouped_routing.py" \
             2>&1 | tail -3) ;;
    # issue 6: each new family at its real shape (truncated where the host cannot hold its experts), budget 0
    # and 16 GiB, 1k context; the hybrids decode through CUDA graphs (recurrent-graphs, measured)
    # DeepSeek-V4's eager decode with and without the hyper-connection kernel (A, B, A, B on one build, budget 0),
    # then a longer 16 GiB run of copy against auto (does the path guard settle?); the kernel's bench and CUDA tests
    v4-ab) (cd /tmp && python3 -m freetoken.kernels.hyper_sinkhorn.bench | tee "$OUT/hyper-sinkhorn-bench.md"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -k cuda \
               "$OLDPWD/tests/kernels/test_hyper_sinkhorn.py" "$OLDPWD/tests/engine/models/test_deepseek_v4.py" \
               2>&1 | tail -3 | tee -a "$OUT/tests.txt")
             args="decode --shape deepseek-v4-flash --layers 8 --expert-format Q8_0 --context 1024 --tokens 16"
             on=FREETOKEN_EXPERIMENTAL=hyper-sinkhorn; rows="--budgets 0 --strategies resident,copy,cpu,auto"
             python3 "$PWD/evals/scripts/bench_one_model.py" $args $rows --commit "$commit" --out "$OUT/v4-a1.md" \
               -- $on $args $rows --commit "$commit ($on)" --out "$OUT/v4-b1.md" \
               -- $args $rows --commit "$commit (again)" --out "$OUT/v4-a2.md" \
               -- $on $args $rows --commit "$commit ($on, again)" --out "$OUT/v4-b2.md" \
               -- $on $args --budgets 16GiB --warmup 160 --strategies copy,auto,auto-noguard \
               --commit "$commit ($on, 160 warm-up tokens)" --out "$OUT/v4-16gib-long.md" 2>&1 \
               | grep -E "^\| (resident|copy|cpu|auto)" ;;
    # one row set per family, each under FAMILY_S seconds: "shape layers format context strategies" (V4 decodes
    # eagerly: no resident-graphs row); expert bytes held to 40-85 GB so one family's host store fits at a time
    d1-families) while read -r shape layers fmt ctx strategies; do [ -z "$shape" ] && continue
             timeout ${FAMILY_S:-170} ft bench decode --shape $shape --layers $layers --expert-format $fmt \
               --context $ctx ${WARMUP:+--warmup $WARMUP} --tokens ${TOKENS:-16} --budgets ${BUDGETS:-0,16GiB} \
               --strategies $strategies --commit "$commit" \
               --out "$OUT/d1-$shape-${layers}l-$fmt-$ctx.md" 2>&1 | grep -vE "Warning|^\s*$" \
               > "$OUT/d1-$shape.log"; tail -9 "$OUT/d1-$shape.log"
             done <<< "${FAMILIES:-deepseek-v4-flash 12 Q8_0 1024 resident,copy,cpu,auto
glm-5 8 Q8_0 4096 resident-graphs,copy,cpu,auto
qwen3-next-80b-a3b 48 Q8_0 1024 resident-graphs,copy,cpu,auto
glm-4.5-air 24 Q8_0 1024 resident-graphs,copy,cpu,auto
deepseek-v3 8 Q8_0 1024 resident-graphs,copy,cpu,auto}" ;;
    d1-qwen35) ft bench decode --shape qwen3.5-35b-a3b --context 1024 --tokens 16 --budgets 0,16GiB \
             --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-qwen3.5-35b-a3b-1k.md" ;;
    d1-qwen3next) ft bench decode --shape qwen3-next-80b-a3b --layers 24 --context 1024 --tokens 16 \
             --budgets 0,16GiB --strategies resident-graphs,copy,cpu,auto --commit "$commit" \
             --out "$OUT/d1-qwen3-next-80b-a3b-24l-1k.md" ;;
    d1-glm5) ft bench decode --shape glm-5 --layers 8 --expert-format Q8_0 --context 4096 --tokens 16 \
             --budgets 0,16GiB --strategies resident-graphs,copy,cpu,auto --commit "$commit" \
             --out "$OUT/d1-glm-5-8l-q8_0-4k.md" ;;  # 4k context: past index_topk (2,048), attention is sparse
    d1-glm45air) ft bench decode --shape glm-4.5-air --layers 24 --context 1024 --tokens 16 --budgets 0,16GiB \
             --strategies resident-graphs,copy,auto --commit "$commit" --out "$OUT/d1-glm-4.5-air-24l-1k.md" ;;
    gptoss-tests) (cd /tmp && python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -rf \
             "$OLDPWD/tests/engine/models/test_gpt_oss.py" "$OLDPWD/tests/engine/test_experts.py" 2>&1 | tail -8) ;;
    d1-gptoss120b) ft bench decode --shape gpt-oss-120b --expert-format MXFP4 --context 1024 --tokens 16 \
             --budgets 0,16GiB --strategies copy,cpu,auto --commit "$commit" --out "$OUT/d1-gpt-oss-120b-mxfp4-1k.md" ;;
    d1-gptoss20b-early) FREETOKEN_EXPERIMENTAL=prefetch-early ft bench decode --shape gpt-oss-20b --context 1024 \
             --tokens 16 --budgets 0,8GiB --strategies copy,cpu,auto --commit "$commit (prefetch-early)" \
             --out "$OUT/d1-gpt-oss-20b-1k-prefetch-early.md" ;;
    d1-gptoss20b) ft bench decode --shape gpt-oss-20b --context 1024 --tokens 16 --budgets 0,8GiB \
             --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-gpt-oss-20b-1k.md" ;;
    d1-deepseekv3) ft bench decode --shape deepseek-v3 --layers 8 --expert-format Q8_0 --context 1024 --tokens 16 \
             --budgets 0,16GiB --strategies copy,cpu,auto --commit "$commit" --out "$OUT/d1-deepseek-v3-8l-q8-1k.md" ;;
    p1-ahead) ft bench prefill --shape qwen3-30b-a3b --prompts 4096,16384,32768 --chunk 16384 --budgets 0 \
          --strategies resident,copy,copy-ahead,auto,auto-ahead --repeats 2 --commit "$commit" \
          --out "$OUT/p1-ahead.md" ;;
    d1-16k-ab) ft bench decode --shape qwen3-30b-a3b --context 16384 --tokens 16 --budgets 0,16GiB \
              --strategies resident-graphs,copy,auto --commit "$commit" --out "$OUT/d1-bf16-16k-ab.md" ;;
    p1-ab) ft bench prefill --shape qwen3-30b-a3b --prompts 4096,16384 --chunk 16384 --budgets 0 \
          --strategies resident,copy,copy-ahead,auto,auto-ahead --repeats 2 --commit "$commit" \
          --out "$OUT/p1-ahead-ab.md" ;;
    p1-main) ft bench prefill --shape qwen3-30b-a3b --prompts 4096,16384,32768 --chunk 16384 --budgets 0 \
          --strategies resident,copy,auto --repeats 2 --commit "$commit" --out "$OUT/p1-bf16.md" ;;
    d1-ab) ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,16GiB \
             --strategies resident-graphs,cpu,auto,auto-noprefetch --commit "$commit" --out "$OUT/d1-ab.md" ;;
    tests) (cd /tmp && python3 -P -m pytest -q -x -p no:cacheprovider --rootdir "$OLDPWD" -k "cuda or kernel" \
             "$OLDPWD/tests/engine/offload" "$OLDPWD/tests/kernels" "$OLDPWD/tests/engine/test_static_decode.py" \
             2>&1 | tail -5) ;;
    kernel) (cd /tmp && python3 -m freetoken.kernels.cpu_experts.bench --torch-baseline --json "$OUT/kernel.json"
             FREETOKEN_CPU_THREADS=15 python3 -m freetoken.kernels.cpu_experts.bench --batches 1 8) ;;
    # Q8_0 on AMX int8 tiles (amx_q8.h): its tests (real tiles, and bit for bit against the emulation), then the
    # variants at 15 threads over 1 GiB and at one thread
    kernel-int8) (cd /tmp && python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -rs -k "int8 or amx" \
                "$OLDPWD/tests/kernels/test_cpu_experts.py" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -4 | tee -a "$OUT/tests.txt"
              v="$OLDPWD/evals/scripts/kernel_variants.py"
              python3 "$v" --rounds 5 --threads 15 --batches 1 2 8 16 32 --out "$OUT/kernel-variants-15t.md" | tail -40
              python3 "$v" --rounds 2 --threads 1 --pool-mib 256 --batches 2 8 32 --out "$OUT/kernel-variants-1t.md" \
                | tail -24) ;;
    kernel-diag) lscpu | grep -E "Thread|Core|Socket|MHz|L2|L3"; cat /sys/kernel/mm/transparent_hugepage/enabled
             grep -H . /sys/devices/system/cpu/vulnerabilities/gather_data_sampling 2>/dev/null
             (cd /tmp && python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" \
                "$OLDPWD/tests/kernels/test_cpu_experts.py" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -3
              v="$OLDPWD/evals/scripts/kernel_variants.py"
              python3 "$v" --rounds 7 --threads 15 --batches 1 2 4 8 --out "$OUT/kernel-variants-15t.md" | tail -40
              python3 "$v" --rounds 5 --threads 15 --pool-mib 24 --batches 1 4 8 --out "$OUT/kernel-variants-15t-small.md" | tail -30
              python3 "$v" --rounds 3 --threads 8 --batches 1 4 8 --out "$OUT/kernel-variants-8t.md" | tail -30
              python3 "$v" --rounds 2 --threads 1 --pool-mib 256 --batches 1 4 8 --out "$OUT/kernel-variants-1t.md" | tail -30) ;;
    d1-now) ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,16GiB \
              --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-bf16-1k.md"
            ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,16GiB --expert-format Q8_0 \
              --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-q8-1k.md" ;;
    d1-guard) (cd /tmp && python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" \
                "$OLDPWD/tests/kernels/test_cpu_experts.py" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -2)
              ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,16GiB \
              --strategies copy,auto,auto-noguard,auto-noprefetch --commit "$commit" --out "$OUT/d1-guard.md" ;;
    d1-matrix) for f in dense Q8_0; do ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 \
                 --budgets 0,8GiB,16GiB --expert-format $f --strategies resident-graphs,copy,cpu,auto \
                 --commit "$commit" --out "$OUT/d1-$f-1k.md" 2>&1 | grep -E "^\| |ways measured"; done
               for f in dense Q8_0; do ft bench decode --shape qwen3-30b-a3b --context 16384 --tokens 16 \
                 --budgets 0,16GiB --expert-format $f --strategies resident-graphs,copy,cpu,auto \
                 --commit "$commit" --out "$OUT/d1-$f-16k.md" 2>&1 | grep -E "^\| |ways measured"; done ;;
    d1-bias-long|d1-ab-long) rm -rf /tmp/md; for f in ${FORMATS:-Q8_0 dense}; do  # A/B/A/B at steady state: 96 tokens' warm-up, 32 timed
             args="decode --shape qwen3-30b-a3b --context ${CONTEXT:-1024} --warmup ${WARMUP:-96} --tokens 32 --budgets ${BUDGETS:-0,16GiB} --expert-format $f"
             on=${B_ENV:-FREETOKEN_EXPERIMENTAL=split-bias}; md=/tmp/md; mkdir -p $md  # B: the variable set
             python3 "$PWD/evals/scripts/bench_one_model.py" $args --strategies resident-graphs,auto --commit "$commit" \
               --out "$md/$f-a1.md" -- $on $args --strategies auto --commit "$commit ($on)" --out "$md/$f-b1.md" \
               -- $args --strategies auto --commit "$commit (again)" --out "$md/$f-a2.md" -- $on $args --strategies auto \
               --commit "$commit ($on, again)" --out "$md/$f-b2.md" 2>&1 | grep -v Warning \
               | tee -a "$OUT/$part.log" | grep -E "^(\| (auto|res)|===)"
           done; cat /tmp/md/*.md > "$OUT/$part.md" ;;
    d1-final) for f in Q8_0 dense; do  # the 1k matrix per format; Q8_0's build also an A/B of the prefetch hold
             m="decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,8GiB,16GiB --expert-format $f \
               --strategies resident-graphs,copy,cpu,auto --commit $commit --out $OUT/d1-$f-1k.md"
             ab="decode --shape qwen3-30b-a3b --context 1024 --warmup 48 --tokens 24 --budgets 8GiB,16GiB \
               --expert-format $f --strategies auto"
             [ $f = Q8_0 ] && m="$m -- $ab --commit $commit --out $OUT/hold-a1.md -- PREFETCH_HOLD=off $ab \
               --commit $commit(PREFETCH_HOLD=off) --out $OUT/hold-b1.md -- $ab --commit $commit(again) \
               --out $OUT/hold-a2.md -- PREFETCH_HOLD=off $ab --commit $commit(PREFETCH_HOLD=off,again) \
               --out $OUT/hold-b2.md"
             python3 "$PWD/evals/scripts/bench_one_model.py" $m 2>&1 | grep -v Warning | tee -a "$OUT/d1-final.log" \
               | grep -E "^(\| (copy|cpu|auto|res)|===)"
           done ;;
    d1-1k) for f in ${FORMATS:-Q8_0 dense}; do  # the 1k rows of the matrix (each format its own build)
             ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,8GiB,16GiB --expert-format $f \
               --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-$f-1k.md" 2>&1 \
               | grep -v -e Warning -e "latest windows" | tee -a "$OUT/d1-1k.log" | grep -E "^\| (copy|cpu|auto|resident)"
           done ;;
    d1-16k-q8) ft bench decode --shape qwen3-30b-a3b --context 16384 --tokens 16 --budgets 0,16GiB --expert-format Q8_0 \
                 --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-Q8_0-16k.md" 2>&1 \
                 | grep -v -e Warning -e "latest windows" | tee -a "$OUT/d1-16k.log" | grep -E "^\| (copy|cpu|auto|res)" ;;
    d1-matrix1) for f in dense Q8_0; do  # the matrix again, one build per format (bench_one_model.py)
               python3 "$PWD/evals/scripts/bench_one_model.py" decode --shape qwen3-30b-a3b --context 1024 \
                 --tokens 16 --budgets 0,8GiB,16GiB --expert-format $f --strategies resident-graphs,copy,cpu,auto \
                 --commit "$commit" --out "$OUT/d1-$f-1k.md" -- decode --shape qwen3-30b-a3b --context 16384 \
                 --tokens 16 --budgets 0,16GiB --expert-format $f --strategies resident-graphs,copy,cpu,auto \
                 --commit "$commit" --out "$OUT/d1-$f-16k.md" 2>&1 | grep -v -e Warning -e "latest windows" \
                 | tee -a "$OUT/d1-matrix.log" | grep -E "^\| (copy|cpu|auto|resident)"; done ;;
    kernel-pinned) (cd /tmp && FREETOKEN_CPU_THREADS=15 python3 -m freetoken.kernels.cpu_experts.bench --batches 1 4 \
             --pinned; grep -i huge /proc/meminfo; cat /sys/kernel/mm/transparent_hugepage/enabled) ;;
    diag) ft bench decode --shape qwen3-30b-a3b --layers 12 --context 256 --tokens 16 --budgets 0 \
            --strategies copy,cpu,auto,auto-noprefetch --probe-mib 512 --commit "$commit" ;;
    profile-q8) for s in auto copy; do
               (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_offload.py" --layers 12 --strategy $s \
                  --expert-format Q8_0 --out "$OUT" | grep -v "expert cache")
             done ;;
    d1-cpu-first-ab) python3 "$PWD/evals/scripts/bench_one_model.py" decode --shape qwen3-30b-a3b --context 1024 \
             --tokens 16 --budgets 0,16GiB --strategies resident-graphs,cpu,auto --commit "$commit" \
             --out "$OUT/d1-1k-defaults.md" -- FREETOKEN_EXPERIMENTAL=cpu-first decode --shape qwen3-30b-a3b \
             --context 1024 --tokens 16 --budgets 0,16GiB --strategies resident-graphs,cpu,auto \
             --commit "$commit (cpu-first)" --out "$OUT/d1-1k-cpu-first.md" ;;
    d1-dispatch-ab) python3 "$PWD/evals/scripts/bench_one_model.py" decode --shape qwen3-30b-a3b --context 1024 \
             --tokens 16 --budgets 0,8GiB,16GiB --strategies resident-graphs,cpu,auto --commit "$commit" \
             --out "$OUT/d1-1k-a.md" -- FREETOKEN_EXPERIMENTAL=cpu-first decode --shape qwen3-30b-a3b \
             --context 1024 --tokens 16 --budgets 0,8GiB,16GiB --strategies resident-graphs,auto \
             --commit "$commit (cpu-first)" --out "$OUT/d1-1k-cpu-first.md" -- decode --shape qwen3-30b-a3b \
             --context 1024 --tokens 16 --budgets 0,8GiB,16GiB --strategies resident-graphs,auto \
             --commit "$commit (again)" --out "$OUT/d1-1k-a2.md" 2>&1 | grep -v Warning | tee "$OUT/d1-dispatch-ab.log" ;;
    d1-cpu-first-abab) args="decode --shape qwen3-30b-a3b --context 1024 --tokens 24 --budgets 0,8GiB,16GiB"
             python3 "$PWD/evals/scripts/bench_one_model.py" $args --strategies resident-graphs,auto \
               --commit "$commit (A1)" --out "$OUT/ab-A1.md" \
               -- FREETOKEN_EXPERIMENTAL=cpu-first $args --strategies auto --commit "$commit (B1)" --out "$OUT/ab-B1.md" \
               -- $args --strategies auto --commit "$commit (A2)" --out "$OUT/ab-A2.md" \
               -- FREETOKEN_EXPERIMENTAL=cpu-first $args --strategies auto --commit "$commit (B2)" --out "$OUT/ab-B2.md" \
               -- $args --strategies auto --commit "$commit (A3)" --out "$OUT/ab-A3.md" \
               -- FREETOKEN_EXPERIMENTAL=cpu-first $args --strategies auto --commit "$commit (B3)" --out "$OUT/ab-B3.md" \
               2>&1 | grep -v -e Warning -e "latest windows" | tee "$OUT/d1-cpu-first-abab.log" ;;
    profile-perf) for fb in "Q8_0 0" "dense 0" "dense 16GiB"; do  # host phases by perf_counter; A/B of a GPU path
               read -r fmt budget <<< "$fb"
               (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_offload.py" --layers 48 --strategy auto --tokens 16 \
                 --warmup 20 --expert-format "$fmt" --budget "$budget" --clock perf --ab ${AB:-prefetch-with-cpu} --out /tmp/prof \
                 2>&1 | grep -v Warning | tee -a "$OUT/profile-perf.txt")
             done ;;
    profile-cache) for f in ${FORMATS:-Q8_0}; do  # host phases at budgets 0, 8 and 16 GiB on one build (48 layers)
               (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_offload.py" --layers 48 --strategy auto --tokens 16 \
                 --warmup 40 --expert-format $f --budget 0,8GiB,16GiB --clock perf --out /tmp/prof 2>&1 \
                 | grep -v Warning | tee -a "$OUT/profile-cache.txt")
             done ;;
    profile-host2) for fb in "Q8_0 0" "dense 0" "dense 16GiB"; do  # the copies' host cost (48 layers)
               read -r fmt budget <<< "$fb"
               (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_offload.py" --layers 48 --strategy auto --tokens 4 \
                 --expert-format "$fmt" --budget "$budget" --out /tmp/prof 2>&1 | grep -v Warning | tail -40 \
                 | tee -a "$OUT/profile-host2.txt")
             done ;;
    profile-host) for s in cpu auto; do  # where the host's time before each CPU share goes (qwen3, 8 layers)
               (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_offload.py" --layers 8 --strategy $s --tokens 8 \
                 --out /tmp/prof 2>&1 | grep -v Warning | tail -32 | tee -a "$OUT/profile-host.txt")
             done ;;
    profile) for s in auto; do
               (cd /tmp && python3 "$OLDPWD/evals/scripts/profile_offload.py" --layers 12 --strategy $s --out "$OUT")
             done ;;
    d1-bf16) ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,8GiB,16GiB \
               --strategies resident-graphs,copy,cpu,auto,auto-noprefetch --commit "$commit" \
               --out "$OUT/d1-bf16-1k.md" ;;
    d1-q8) ft bench decode --shape qwen3-30b-a3b --context 1024 --tokens 16 --budgets 0,8GiB \
             --expert-format Q8_0 --strategies copy,cpu,auto --probe-mib 512 --commit "$commit" \
             --out "$OUT/d1-q8-1k.md" ;;
    wake-bench) (cd /tmp && for f in Q8_0 BF16; do FREETOKEN_CPU_THREADS=15 python3 -m freetoken.kernels.cpu_experts.wake_bench \
               --format $f --calls 300; done | tee "$OUT/wake-bench.md") ;;
    # the paged decode kernel of this tree against other copies of kernel.py ($ATTN_FILES, e.g. .carry/paged-kernel-X.py),
    # alternating, each twice; one token, Qwen3-30B-A3B's attention
    attn-ab) sites=/tmp/site; for f in ${ATTN_FILES:-}; do d=/tmp/site-$(basename "$f" .py); rm -rf "$d"
               cp -r /tmp/site "$d" && cp "$f" "$d/freetoken/kernels/paged_decode/kernel.py" && sites="$sites $d"; done
             for round in 1 2; do for site in $sites; do echo "== $site round $round"
               (cd /tmp && PYTHONPATH=$site python3 -m freetoken.kernels.paged_decode.bench | tail -4); done; done \
               | tee "$OUT/attn-ab.txt" ;;
    attn-sweep) (cd /tmp && python3 "$OLDPWD/evals/scripts/paged_decode_sweep.py" | tee "$OUT/paged-decode-sweep.md") ;;
    # Q8_0 on the bf16 tiles with software prefetch while blocks are dequantized (kernel_variants.py: every variant
    # each round, 15 threads, 1 GiB pool), then the tiles' tests
    # GPU path cpu-caller-waits (the GPU's thread only waits for a layer's CPU share; a worker more) against the
    # default, A/B/A/B in separate processes (the pool is sized at start), budget 0 (BUDGETS), per format (FORMATS)
    d1-caller-ab) for f in ${FORMATS:-Q8_0 dense}; do for arm in a1 b1 a2 b2; do
               x=""; [ ${arm:0:1} = b ] && x=cpu-caller-waits
               FREETOKEN_EXPERIMENTAL=$x ft bench decode --shape qwen3-30b-a3b --context 1024 --warmup ${WARMUP:-48} \
                 --tokens 24 --budgets ${BUDGETS:-0} --expert-format $f --strategies auto --commit "$commit ${x:-default}" \
                 --out "$OUT/d1-caller-$f-$arm.md" 2>&1 | grep -v Warning | tee -a "$OUT/d1-caller-ab.log" \
                 | grep -E "^\| auto|CPU share started|CPU kernel, mean" | sed "s/^/$f $arm: /"; done; done ;;
    # Q8_0 at 2-5 tokens: the 16-row int16 path (off by default) against the fp32 path with its 4 KiB row prefetch
    # (the default), and both without prefetch; then every kernel test on this CPU
    # the kernel's job on experts just read into the caches against cold ones (evals/scripts/warm_experts.py)
    warm-experts) (cd /tmp && python3 "$OLDPWD/evals/scripts/warm_experts.py" --threads 15 --experts 1 2 4 6 \
               | tee "$OUT/warm-experts.md"
             python3 "$OLDPWD/evals/scripts/warm_experts.py" --threads 15 --experts 2 4 --tokens 2 --formats Q8_0 \
               | tail -2 | tee -a "$OUT/warm-experts.md") ;;
    q16-rows) (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_variants.py" --rounds ${ROUNDS:-7} --batches 1 2 3 4 5 \
               --formats Q8_0 --variants default "Q8_0 int16 rows" "no vector prefetch" \
               | grep -v "^round" | tee "$OUT/kernel-variants-q16-rows.md"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" "$OLDPWD/tests/kernels/test_cpu_experts.py" \
               "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -3 | tee -a "$OUT/tests.txt") ;;
    # software prefetch ahead in each row on the vector and int16 paths (ft_set_dots_prefetch) at 1-8 tokens per
    # expert, 1/4/16 KiB against none (tiles take BF16 from 2 tokens and Q8_0 from 6: those rows are controls),
    # then every kernel test on this CPU (real tiles, AVX-512)
    # Q8_0 rows dequantized for the tiles as 4 interleaved runs (default since 2026-12-08) against 1, 2 and 8, and
    # tiles from 4 tokens; then the tile tests on real tiles
    kernel-streams) (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_variants.py" --rounds ${ROUNDS:-7} --formats Q8_0 \
               --batches 4 5 6 8 16 --variants default "Q8_0 tiles, dequantized as one run" "Q8_0 tiles, dequantized as 2 runs" \
               "Q8_0 tiles, dequantized as 8 runs" "Q8_0 tiles from 4" | grep -v "^round" | tee "$OUT/kernel-variants-streams.md"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" \
               2>&1 | tail -3 | tee -a "$OUT/tests.txt") ;;
    dots-prefetch) (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_variants.py" --rounds ${ROUNDS:-7} --batches 1 2 3 4 5 8 \
               --variants default "Q8_0 fp32 path" "no vector prefetch" "vector prefetch 1 KiB" "vector prefetch 4 KiB" "vector prefetch 16 KiB" \
               | grep -v "^round" | tee "$OUT/kernel-variants-prefetch.md"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" "$OLDPWD/tests/kernels/test_cpu_experts.py" \
               "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -3 | tee -a "$OUT/tests.txt") ;;
    # the epilogues (activations, pair outputs) 16 values at a time against one by one, every variant at 6-64 tokens
    act-vector) (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_variants.py" --rounds 5 --batches 6 8 16 32 64 \
               | grep -v "^round" | tee "$OUT/kernel-variants.md"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -k "amx or tile or vector" \
               "$OLDPWD/tests/kernels/test_cpu_experts.py" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -3 | tee -a "$OUT/tests.txt") ;;
    # every variant of kernel_variants.py (token tiles in pairs against one a pass at 32-64 tokens, the dequantization
    # prefetch's distances at 6-16), the launch path at prefill-sized batches, and the tile tests
    tile-pairs) (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_variants.py" --rounds 7 --batches 1 2 4 6 8 16 32 48 64 \
               | tee "$OUT/kernel-variants.md"
             FREETOKEN_CPU_THREADS=15 python3 -m freetoken.kernels.cpu_experts.bench --batches 1 8 16 32 64 \
               | tee "$OUT/kernel-prefill.txt"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -k "amx or prefetch or tile" \
               "$OLDPWD/tests/kernels/test_cpu_experts.py" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -3 | tee -a "$OUT/tests.txt") ;;
    dequant-prefetch) (cd /tmp && python3 "$OLDPWD/evals/scripts/kernel_variants.py" --rounds 7 --formats Q8_0 \
               --batches 6 8 16 | tee "$OUT/dequant-prefetch.md"
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -k "amx or prefetch" \
               "$OLDPWD/tests/kernels/test_cpu_experts.py" "$OLDPWD/tests/kernels/test_cpu_expert_tiles.py" 2>&1 | tail -3 | tee -a "$OUT/tests.txt") ;;
    # one thread's arithmetic ceiling per vector path with the weights in L2 (the pool's DRAM runs set against it)
    # (alone, then one of 15 copies running at once: what all cores busy does to each core's rate)
    dots-in-cache) cc -O3 -march=native -std=gnu11 -pthread -o /tmp/dots evals/scripts/dots_in_cache.c -lm \
             && { echo "== alone"; /tmp/dots; echo "== one of 15 at once"
                  for i in $(seq 14); do /tmp/dots > /dev/null & done; /tmp/dots; wait; } | tee "$OUT/dots-in-cache.txt" ;;
    kernel-launch) (cd /tmp && FREETOKEN_CPU_THREADS=15 python3 -m freetoken.kernels.cpu_experts.bench --batches 1 2 4 8 \
             | tee "$OUT/kernel-launch.txt") ;;
    # the vector paths against each other at 15 threads: block formats on the bf16 dot path against the fp32 path
    # below the tile threshold, then AMX tiles against the vector paths (which token counts tiles should take)
    kernel-paths) (cd /tmp && v="$OLDPWD/evals/scripts/kernel_path_ab.py"; export FREETOKEN_CPU_THREADS=15
             python3 "$v" block-bf16 1024 --formats Q8_0 MXFP4 --batches 2 4 | tee "$OUT/kernel-paths.txt"
             python3 "$v" amx 1024 --batches 2 4 6 8 16 | tee -a "$OUT/kernel-paths.txt") ;;
    contention) (cd /tmp && for t in 15 16 17; do FREETOKEN_CPU_THREADS=$t python3 -m freetoken.kernels.cpu_experts.contention_bench \
               --experts 8 --noise 2 --rounds 2; done | tee "$OUT/contention.md") ;;
    copy-batch-check) (cd /tmp && nm -D $(python3 -c "import torch, glob, os; print(glob.glob(os.path.dirname(torch.__file__) + '/../nvidia/*/lib/libcudart.so*')[0])") 2>/dev/null | grep -i batch
             python3 -P -m pytest -q -p no:cacheprovider --rootdir "$OLDPWD" -k batched -rs \
               "$OLDPWD/tests/engine/offload/test_quantized_experts.py" 2>&1 | tail -3
             python3 -c "import sys; sys.path.insert(0, '$OLDPWD/evals/scripts'); import torch, copy_size_cost as c; torch.cuda.init(); c.batch_table(30)" \
               | tee "$OUT/copy-batch.md") ;;
    copy-size-cost) (cd /tmp && python3 "$OLDPWD/evals/scripts/copy_size_cost.py" | tee "$OUT/copy-size-cost.md") ;;
    copier-cost) (cd /tmp && python3 "$OLDPWD/evals/scripts/copier_host_cost.py" | tee "$OUT/copier-host-cost.md") ;;
    d1-q8-nographs) python3 -c "import sys; from freetoken.engine.offload import row_dequant; row_dequant.DEQUANT_GRAPHS = False
from freetoken.cli import main; sys.exit(main(sys.argv[1:]))" bench decode --shape qwen3-30b-a3b --context 1024 \
             --tokens 16 --budgets 0,8GiB --expert-format Q8_0 --strategies copy,auto --probe-mib 512 \
             --commit "$commit (dequantiser launched, no graphs)" --out "$OUT/d1-q8-1k-nographs.md" ;;
    d1-16k) ft bench decode --shape qwen3-30b-a3b --context 16384 --tokens 16 --budgets 0,8GiB,16GiB \
              --strategies resident-graphs,copy,cpu,auto --commit "$commit" --out "$OUT/d1-bf16-16k.md" ;;
    p1) ft bench prefill --shape qwen3-30b-a3b --prompts 4096,16384,32768 --chunk 16384 --budgets 0,8GiB \
          --strategies resident,copy,auto --commit "$commit" --out "$OUT/p1-bf16.md" ;;
    hf) ft bench decode --shape qwen3-30b-a3b --layers 16 --context 1024 --tokens 8 --budgets 0 \
          --strategies resident-graphs,auto,hf-accelerate --commit "$commit" --out "$OUT/d1-hf-16layers.md" ;;
  esac
done
