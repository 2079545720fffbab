#!/usr/bin/env bash
# The real pair on two GPUs: does the second GPU pay? Steps that each fit one device call.
# Before: the 29 pieces of .mc (../shared/tools/carry-chunks.sh on the two default GGUF files, with
# the Node.js docs text as .mc/nodejs.txt), .whl2 (gguf, sse-starlette, prometheus-client wheels)
# and, for `serve`, .whlray (../shared/tools/device-wheels.sh .whlray), carried as each step says.
#   bash benchmarks/gpu_overlap.sh piece NNN     # carry .mc/NNN (first call: also .whl2)
#   bash benchmarks/gpu_overlap.sh join          # carry .mc/028 .mc/MANIFEST .mc/join.sh .mc/nodejs.txt
#   bash benchmarks/gpu_overlap.sh overlap       # in-process: ar, 1 GPU, 2 GPUs, 2 GPUs + overlap
#   bash benchmarks/gpu_overlap.sh serve MODE... # served: one app per mode (carry .whlray)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled OUT=${OUT:-/tmp/out}
M=/tmp/m; T=$M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; D=$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
LENGTHS=${LENGTHS:-8192,16384,30000}
install() { for w in "$@"; do [ -d "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w"/*.whl; done; }
case "$1" in
  piece) install .whl2; mkdir -p /tmp/mc && cp ".mc/$2" /tmp/mc/ && ls /tmp/mc | wc -l ;;
  join) install .whl2; cp .mc/028 .mc/MANIFEST /tmp/mc/ && MC_DIR=/tmp/mc bash .mc/join.sh --join $M > /dev/null \
          && cp .mc/nodejs.txt /tmp/nodejs.txt && ls $M ;;
  overlap) cd benchmarks && python3 overlap.py --target $T --draft $D --text-file /tmp/nodejs.txt --lengths $LENGTHS \
             --modes ${MODES:-specextend} --overlap ${OVERLAP:-8:3} > "$OUT/overlap.log" 2>&1; grep -E "^\||^check" "$OUT/overlap.log" | tail -30 ;;
  serve) install .whlray .whl2; shift; for mode in "$@"; do
           python3 benchmarks/serve_bench.py --lengths $LENGTHS --text-file /tmp/nodejs.txt --tokenizer $T \
             target=$T draft=$D num_gpus=1 mode=$mode > "$OUT/serve-$mode.log" 2>&1
           echo "== served $mode"; grep -E "^start-up|^\|" "$OUT/serve-$mode.log" | tail -6; done ;;
esac
