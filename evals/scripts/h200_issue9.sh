#!/usr/bin/env bash
# Runs on the H200 test machine (device tool): issue 9's A1 agent replays with the D1 model.
#   bash evals/scripts/h200_issue9.sh COMMIT PART...
#   PART: model | reuse | reuse-stream | no-reuse | no-reuse-think | no-reuse-norest
# model: the D1 model (synthetic Qwen3-30B-A3B, 48 layers, experts Q8_0) as a GGUF at $MODEL (kept between calls
# while the machine stays warm); reuse / no-reuse: one `ft serve --expert-cache $BUDGET` (a consumer card's
# budget; a KV pool for the model's whole 40k context) with and without the prefix cache, and every trace in
# $TRACES replayed against it by `ft eval`; reuse-stream: reuse with FREETOKEN_EXPERIMENTAL=stream-short-chunks,
# for the traces in $STREAM_TRACES. References: 3 short single-turn requests before and after each trace, and 3
# over a prompt of the trace's median context (REF_CONTEXT overrides it; 0: none; without reuse each costs a
# prefill, ~3 s at 30k). Replies are shortened (--param) so the runs fit the device's 10-minute calls; prompts keep
# their full lengths. The run folders are packed into $OUT/a1.tgz after each trace (the device
# returns only a few files). Wheels: .carry/whl (gguf), .carry/srv (server), .carry/plot (matplotlib for the
# report), .carry/tok (SmolLM2's tokenizer for the exported model).
set -uo pipefail
commit=$1; shift
export PYTHONUNBUFFERED=1
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: use the ft already on PATH (a local check of the script)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .carry/whl/*.whl \
    $(ls .carry/srv/*.whl .carry/plot/*.whl 2>/dev/null) . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH FREETOKEN_HOME=/tmp/ft
fi
export FREETOKEN_DEFAULT_MODEL=$PWD/.carry/tok/smollm2-tokenizer.gguf
MODEL=${MODEL:-/tmp/q3-48l-q8.gguf}
BUDGET=${BUDGET:-16GiB}
TRACES=${TRACES:-claude-code codex openclaw opencode reasoning}
STREAM_TRACES=${STREAM_TRACES:-claude-code}
RUNS=/tmp/a1
SHORT="--param output_tokens=32 --param final_output_tokens=64"

serve_and_replay() {  # $1: label, $2: traces, rest: extra ft serve args
  local label=$1 traces=$2; shift 2
  local port=19190 log=$RUNS/serve-$label.log
  ft serve --model "$MODEL" --port $port --expert-cache "$BUDGET" --kv-cache 6GiB "$@" > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do grep -q "serving " "$log" && break; kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  grep "serving \|expert cache" "$log" | head -3
  # the host's reported CPU clock, mean over its CPUs, once a second (where the machine reports a live one)
  (while sleep 1; do echo "$(date +%s.%N) $(awk '/cpu MHz/ {s += $4; n++} END {printf "%.0f", s / n}' /proc/cpuinfo)"
   done) > "$RUNS/mhz-$label.log" 2>/dev/null &
  local sampler=$!
  for t in $traces; do
    local params=$SHORT
    [ "$t" = reasoning ] && params="--param output_tokens=256"
    # references also over a prompt of the trace's median context (REF_CONTEXT=0: short ones only)
    local context=${REF_CONTEXT:-$(case $t in claude-code) echo 32000;; openclaw) echo 29000;; codex) echo 16500;;
                                   opencode) echo 21500;; *) echo 0;; esac)}
    params="$params --reference-context $context"
    echo "--- $t ($label) $(date +%T)"
    timeout 300 ft eval --trace "$t" $params ${EVAL_ARGS:-} --endpoint "http://127.0.0.1:$port" --label "$label" -q \
      --out "$RUNS/$t-$label" 2>&1 | grep -v "^freetoken:" | tail -16
    python3 evals/scripts/a1_turns.py --brief "$RUNS/$t-$label/result.json" 2>/dev/null
    tar czf "$OUT/a1.tgz" -C "$RUNS" .
  done
  kill $pid $sampler; wait $pid 2>/dev/null
  tar czf "$OUT/a1.tgz" -C "$RUNS" .
}

mkdir -p "$RUNS"
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    model) [ -f "$MODEL" ] || ft bench export --shape qwen3-30b-a3b --format gguf-q8_0 --out "$MODEL" | tail -2
           ls -la "$MODEL" ;;
    reuse) serve_and_replay reuse "$TRACES" ;;
    reuse-stream) export FREETOKEN_EXPERIMENTAL=stream-short-chunks
                  serve_and_replay reuse-stream "$STREAM_TRACES"; unset FREETOKEN_EXPERIMENTAL ;;
    no-reuse) serve_and_replay no-reuse "$TRACES" --no-prefix-cache ;;
    # each turn's think time honoured (idle gaps as an agent's tool calls leave them): does the host recover?
    no-reuse-think) EVAL_ARGS=--think serve_and_replay no-reuse-think "$TRACES" --no-prefix-cache ;;
    # without the path guard's rest after prefills (GPU path guard-rest, on by default): no-reuse's baseline
    no-reuse-norest) export FREETOKEN_DISABLE=guard-rest
                     serve_and_replay no-reuse-norest "$TRACES" --no-prefix-cache; unset FREETOKEN_DISABLE ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T) commit $commit"
