#!/usr/bin/env bash
# The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft, GGUF) on the GPU machine, in steps that each
# fit one device call. Before: `.whl` (device-wheels.sh) and the 29 pieces of `.mc` (carry-chunks.sh)
# carried one call at a time; see benchmarks/README.md.
#   bash benchmarks/gpu_real_pair.sh wheels|piece NNN|join|e2e|serve
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled OUT=${OUT:-/tmp/out}
M=/tmp/m; T=$M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; D=$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
LENGTHS=${LENGTHS:-8192,16384}
case "$1" in
  wheels) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && echo installed ;;
  piece) mkdir -p /tmp/mc && cp ".mc/$2" /tmp/mc/ && ls /tmp/mc | wc -l ;;
  join) cp .mc/MANIFEST /tmp/mc/ && cp .mc/nodejs.txt /tmp/nodejs.txt && MC_DIR=/tmp/mc bash .mc/join.sh --join $M && ls -la $M ;;
  e2e) python3 benchmarks/e2e.py --target $T --draft $D --lengths $LENGTHS --no-replay --text-file /tmp/nodejs.txt \
         --skip-hf --tree-nodes 16 ${E2E_ARGS:-} > "$OUT/e2e-real.log" 2>&1; grep -v '^{' "$OUT/e2e-real.log" | tail -${TAIL:-12} ;;
  serve) nvidia-smi -L
         python3 benchmarks/serve_bench.py --lengths $LENGTHS --text-file /tmp/nodejs.txt --tokenizer $T \
           target=$T draft=$D num_gpus=1 mode=${MODE:-specextend} > "$OUT/serve-real.log" 2>&1
         grep -E "^L=|^start-up|^\||bus|MiB" "$OUT/serve-real.log" | cut -c1-400 | tail -14 ;;
esac
