#!/usr/bin/env bash
# One device call: CUDA checks of the step graphs, then step times and end-to-end (graphs on/off).
#   run: bash benchmarks/gpu_graphs.sh [1|2|all]  (on the GPU machine; writes logs to $OUT)
set -uo pipefail
export PYTHONPATH=$PWD OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PART=${1:-all}
if [[ $PART == all || $PART == 1 ]]; then
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q --tb=short tests/test_graphs.py tests/test_attention.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -20
python3 benchmarks/step_times.py --lengths ${LENGTHS:-4096,16384,32768} --reps 10 --cuda-graphs both \
    > "$OUT/step_times.log" 2>&1; tail -8 "$OUT/step_times.log" | head -7
fi
if [[ $PART == all || $PART == 2 ]]; then
python3 -m pytest -q --tb=short tests/test_graphs.py > "$OUT/pytest_graphs.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest_graphs.log" | head -20
python3 benchmarks/step_times.py --draft random:llama-3.2-1b --lengths 16384 --reps 8 --cuda-graphs both \
    > "$OUT/step_times_1b.log" 2>&1; tail -4 "$OUT/step_times_1b.log" | head -3
python3 benchmarks/e2e.py --lengths 8192,16384 --replay-constant 3 --skip-hf > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | tail -12
fi
if [[ $PART == prof ]]; then
(cd benchmarks && python3 profile_step.py > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"; tail -c 3000 "$OUT/profile.log"
fi
if [[ $PART == 3 ]]; then  # everything after a kernel change: checks, step table, profile, end to end
python3 -m pytest -q --tb=short tests/test_graphs.py tests/test_attention.py tests/test_models.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 4096,16384,32768 --reps 10 --cuda-graphs both > "$OUT/step_times.log" 2>&1
tail -8 "$OUT/step_times.log" | head -7
(cd benchmarks && python3 profile_step.py > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
python3 benchmarks/e2e.py --lengths 8192,16384 --replay-constant 3 --skip-hf > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | tail -11
fi
if [[ $PART == 4 ]]; then  # draft geometries: checks, draft step times, end to end
python3 -m pytest -q --tb=short tests/test_graphs.py tests/test_attention.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 4096,16384 --reps 10 --cuda-graphs on > "$OUT/step_times.log" 2>&1
tail -6 "$OUT/step_times.log" | head -5
python3 benchmarks/step_times.py --draft random:qwen2.5-0.5b --lengths 16384 --reps 10 --cuda-graphs on > "$OUT/step_times_05b.log" 2>&1
tail -4 "$OUT/step_times_05b.log" | head -3
(cd benchmarks && python3 profile_step.py --draft random:qwen2.5-0.5b > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
python3 benchmarks/e2e.py --lengths 16384 --replay-constant 3 --skip-hf > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | tail -6
fi
if [[ $PART == 6 ]]; then  # leaner per-layer prefix call: checks, 8B target + two drafts, profile, end to end
python3 -m pytest -q --tb=short tests/test_graphs.py tests/test_attention.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 4096,16384,32768 --reps 10 --cuda-graphs both > "$OUT/step_times.log" 2>&1
tail -9 "$OUT/step_times.log" | head -8
python3 benchmarks/step_times.py --draft random:qwen2.5-0.5b --lengths 16384 --reps 10 --cuda-graphs on \
    --tree-nodes 16 --tree-depth 6 > "$OUT/step_times_05b.log" 2>&1
grep -E "^\| 16384" "$OUT/step_times_05b.log"
(cd benchmarks && python3 profile_step.py --draft random:qwen2.5-0.5b > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
python3 benchmarks/e2e.py --lengths 8192,16384 --replay-constant 3 --skip-hf > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | tail -11
fi
if [[ $PART == 7 ]]; then  # Inductor-compiled segments: checks, step times plain vs compiled, profile, end to end
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q --tb=short tests/test_graphs.py tests/test_attention.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths ${LENGTHS:-4096,16384,32768} --reps 10 --cuda-graphs on,compiled \
    > "$OUT/step_times.log" 2>&1
grep -E "^\| |^L=" "$OUT/step_times.log" | tail -9
fi
if [[ $PART == 8 ]]; then  # compiled segments: profile, end to end
(cd benchmarks && python3 profile_step.py --torch-compile > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
python3 benchmarks/e2e.py --lengths 8192,16384 --replay-constant 3 --skip-hf --torch-compile > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | tail -11
fi
if [[ $PART == 9 ]]; then  # full-step graphs (Triton prefix kernel): checks, step times of every graph mode
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -x --tb=short tests/test_full_graphs.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths ${LENGTHS:-16384,4096,32768} --reps 10 --cuda-graphs ${MODES:-on,full,full-compiled} \
    > "$OUT/step_times.log" 2>&1
grep -E "^\| |^L=|Error" "$OUT/step_times.log" | tail -12
fi
if [[ $PART == 10 ]]; then  # tuned Triton prefix kernel: step times at 16K, the 50-node tree and the app's 16-node tree
python3 -m pytest -q -x --tb=short tests/test_full_graphs.py -k "partials or interleaved" > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
for NODES in 50 16; do
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs ${MODES:-on,full-compiled} --tree-nodes $NODES \
    --tree-depth $((NODES == 50 ? 10 : 6)) > "$OUT/step_times_tree$NODES.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_tree$NODES.log" | tail -3
done
fi
if [[ $PART == 11 ]]; then  # every graph mode at 16K, the app's 16-node tree
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs on,full,full-compiled --tree-nodes 16 \
    --tree-depth 6 > "$OUT/step_times_tree16.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_tree16.log" | tail -4
fi
if [[ $PART == 12 ]]; then  # end to end, 8B + 68M replayed, piecewise vs full-step graphs
for G in "--piecewise" ""; do
python3 benchmarks/e2e.py --lengths 16384 --replay-constant 3 --skip-hf $G > "$OUT/e2e${G}.log" 2>&1
grep -v '^{' "$OUT/e2e${G}.log" | tail -6
done
fi
if [[ $PART == 13 ]]; then  # Triton-fused layer kernels (fused_layer.py): CUDA checks, step times, real-pair shape draft
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q --tb=short tests/test_fused_layer.py tests/test_full_graphs.py tests/test_draft_expand.py \
    > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs full,full-fused,full-compiled --tree-nodes 16 \
    --tree-depth 6 > "$OUT/step_times_fused.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_fused.log" | tail -4
python3 benchmarks/step_times.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --lengths 16384 --reps 10 \
    --cuda-graphs full,full-fused --tree-nodes 16 --tree-depth 6 > "$OUT/step_times_fused_qwen.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_fused_qwen.log" | tail -3
fi
if [[ $PART == 14 ]]; then  # prefix kernel + fused combine: how many splits pay for their partials (8B layer, 16K)
python3 benchmarks/prefix_kernel.py --tokens 1,17,51 --with-combine --split-factors 0.25,0.5,1 > "$OUT/prefix_combine.log" 2>&1
grep -E "^T=|^\| " "$OUT/prefix_combine.log" | tail -8
fi
if [[ $PART == 15 ]]; then  # split graph launches + combine with unrolled split loads: checks, step times, profile
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q --tb=short tests/test_fused_layer.py tests/test_full_graphs.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs full-fused,full-fused-1 --tree-nodes 16 \
    --tree-depth 6 > "$OUT/step_times_split.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_split.log" | tail -3
python3 benchmarks/step_times.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --lengths 16384 --reps 10 \
    --cuda-graphs full-fused,full-fused-1 --tree-nodes 16 --tree-depth 6 > "$OUT/step_times_split_qwen.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_split_qwen.log" | tail -2
(cd benchmarks && python3 profile_step.py --only-verify --rows 14 > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
fi
if [[ $PART == 16 ]]; then  # prefix kernel with 16-byte pipelined loads: re-tune sweep, step times, profile
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -x --tb=short tests/test_full_graphs.py tests/test_attention.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/prefix_kernel.py --tokens 1,17,51 --with-combine --split-factors 0.5,1 > "$OUT/prefix_combine.log" 2>&1
grep -E "^\| " "$OUT/prefix_combine.log" | tail -4
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs full-fused --tree-nodes 16 \
    --tree-depth 6 > "$OUT/step_times.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times.log" | tail -2
python3 benchmarks/step_times.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --lengths 16384 --reps 10 \
    --cuda-graphs full-fused --tree-nodes 16 --tree-depth 6 > "$OUT/step_times_qwen.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_qwen.log" | tail -1
(cd benchmarks && python3 profile_step.py --only-verify --rows 14 > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
fi
if [[ $PART == 17 ]]; then  # re-tuned prefix configs, Triton RMSNorm, in-place residual adds: checks, step times, profile
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q --tb=short tests/test_fused_layer.py tests/test_full_graphs.py tests/test_draft_expand.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 16384,4096,32768 --reps 10 --cuda-graphs full-fused --tree-nodes 16 \
    --tree-depth 6 > "$OUT/step_times.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times.log" | tail -4
python3 benchmarks/step_times.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --lengths 16384 --reps 10 \
    --cuda-graphs full-fused --tree-nodes 16 --tree-depth 6 > "$OUT/step_times_qwen.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_qwen.log" | tail -1
(cd benchmarks && python3 profile_step.py --only-verify --rows 14 > "$OUT/profile.log" 2>&1); grep -E "^===" "$OUT/profile.log"
fi
if [[ $PART == 18 ]]; then  # final numbers of the session: step times at 4K/16K/32K (16-node tree), 50-node tree, end to end
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/step_times.py --lengths 16384,4096,32768 --reps 10 --cuda-graphs full-fused --tree-nodes 16 \
    --tree-depth 6 > "$OUT/step_times.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times.log" | tail -4
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs full-fused > "$OUT/step_times_tree50.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_tree50.log" | tail -1
python3 benchmarks/e2e.py --lengths 16384 --replay-constant 3 --skip-hf > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | tail -5
python3 benchmarks/e2e.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --lengths 8192,16384 \
    --replay-constant 4 --tree-nodes 16 --skip-hf > "$OUT/e2e_qwen.log" 2>&1
grep -v '^{' "$OUT/e2e_qwen.log" | tail -6
fi
if [[ $PART == 19 ]]; then  # the table at 8K with both drafts; where a 68M draft step's time goes
python3 benchmarks/step_times.py --lengths 8192 --reps 10 --cuda-graphs full-fused --tree-nodes 16 --tree-depth 6 \
    > "$OUT/step_times_8k.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_8k.log" | tail -1
python3 benchmarks/step_times.py --draft random:llama-3.2-1b --lengths 16384,32768 --reps 10 --cuda-graphs full-fused \
    --tree-nodes 16 --tree-depth 6 > "$OUT/step_times_1b.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times_1b.log" | tail -2
(cd benchmarks && python3 profile_step.py --draft random:llama-68m --rows 24 > "$OUT/profile_68m.log" 2>&1); grep -E "^===" "$OUT/profile_68m.log"
fi
if [[ $PART == 20 ]]; then  # the draft's per-level bookkeeping as CUDA graphs (draft/expand.PostGraphs): checks, draft steps, end to end
timeout 240 python3 -m pytest -q --tb=short tests/test_draft_expand.py tests/test_lossless.py > "$OUT/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$OUT/pytest.log" | head -12
python3 benchmarks/step_times.py --lengths 16384 --reps 10 --cuda-graphs full-fused --tree-nodes 16 --tree-depth 6 \
    > "$OUT/step_times.log" 2>&1
grep -E "^\| |Error" "$OUT/step_times.log" | tail -1
python3 benchmarks/e2e.py --lengths 16384 --replay-constant 3 --skip-hf > "$OUT/e2e.log" 2>&1
grep -v '^{' "$OUT/e2e.log" | grep "^| 16384"
python3 benchmarks/e2e.py --target random:qwen2.5-1.5b --draft random:qwen2.5-0.5b --lengths 8192,16384 \
    --replay-constant 4 --tree-nodes 16 --skip-hf > "$OUT/e2e_qwen.log" 2>&1
grep -v '^{' "$OUT/e2e_qwen.log" | grep -E "^\| (8192|16384)"
fi
