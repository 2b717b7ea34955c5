#!/usr/bin/env bash
# The checks that need a GPU, in one run, for a lent machine whose time is short (docs/benchmarks.md says
# what each one gave):
#   tests   the CUDA tests (tests/test_cuda.py)
#   table2  GPipe's Table 2 predicted from this GPU's profile of AmoebaNet-D (18, 256) on 224x224 images,
#           with torchgpipe's batch and checkpoint mode per cell
#   plan    the planner against measurement on one GPU (K=1; the measured peak is CUDA's max_memory_allocated)
#   split   input gradients first, one stage at a time (benchmarks/split_cost.py), at micro-batches of 8 and 32
# Results go to $OUT (default gpu-results/), a log and a JSON per check.
#
#   bash benchmarks/gpu.sh               # all four, at most 9 minutes on an H100
#   bash benchmarks/gpu.sh table2 plan
set -u -o pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/gpu.txt"
for check in "${@:-tests table2 plan split}"; do
  for c in $check; do
    case $c in
      tests) timeout 150 $PY -m pytest -q tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/test_cuda.log" ;;
      table2) timeout 150 $PY benchmarks/plan.py --device cuda --table2-only --table2-layers 18 --table2-filters 256 \
          --table2-stem imagenet --table2-image 224 --table2-classes 1000 --table2-settings torchgpipe \
          --table2-profile "$OUT/table2_profile.pt" --table2-link 12 10 --out "$OUT/table2.json" 2>&1 | tee "$OUT/table2.log" ;;
      plan) timeout 170 $PY benchmarks/plan.py --device cuda --stages 1 --skip-table2 --models amoebanet transformer \
          --chunks 1 2 4 8 --amoebanet-layers 18 --amoebanet-filters 128 --image 32 --batch-size 64 \
          --blocks 8 --width 512 --sequence 128 --repeats 3 --out "$OUT/plan_k1.json" 2>&1 | tee "$OUT/plan_k1.log" ;;
      split) for b in 64 256; do
          timeout 100 $PY benchmarks/split_cost.py --device cuda --amoebanet-layers 18 --amoebanet-filters 128 \
            --blocks 8 --width 512 --sequence 128 --batch-size $b --chunks 8 --out "$OUT/split_cost_$b.json" 2>&1 \
            | tee "$OUT/split_cost_$b.log"
        done ;;
      *) echo "unknown check $c (tests, table2, plan, split)"; exit 2 ;;
    esac
  done
done
