#!/usr/bin/env bash
# Start the service on the default models (Qwen2.5-Coder 1.5B target, 0.5B draft), wait until it is
# ready, ask it one question through the OpenAI-compatible API, and keep serving until Ctrl-C.
# Extra arguments go to the app, e.g. `bash scripts/serve-and-ask.sh mode=sd`.
set -euo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
port=${PORT:-8000}
specextend fetch-models
serve run deploy.app:specextend "$@" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null' EXIT INT TERM
echo "waiting for the models to load (a few minutes on a CPU)..."
until curl -sf "localhost:$port/health" >/dev/null; do
  kill -0 $server 2>/dev/null || { echo "serve run exited"; exit 1; }
  sleep 5
done
model=$(curl -s "localhost:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
curl -s "localhost:$port/v1/chat/completions" -H 'content-type: application/json' -d "{
  \"model\": \"$model\", \"max_tokens\": 48,
  \"messages\": [{\"role\": \"user\", \"content\": \"Write a one-line Python expression that reverses a string s.\"}]
}" | python3 -m json.tool
echo "serving on http://localhost:$port/v1 (Ctrl-C stops)"
wait $server
