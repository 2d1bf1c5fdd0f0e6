#!/usr/bin/env bash
# The figures docs/cli.md, docs/solvers.md and README.md quote for a new user's first hour,
# measured again (prints them; run from the repository root, after the Quick start has put
# MNIST and its LMDBs in place):
#
#   bash benchmarks/quickstart_figures.sh          # the shortened recipe, time, test, log lines
#   bash benchmarks/quickstart_figures.sh --load   # also: the LeNet example with 1 and 2 BLAS
#                                                  # threads, alone and beside 3 busy processes
#   bash benchmarks/quickstart_figures.sh --recipe # also: the whole recipe (10,000 iterations)
#
# Each figure depends on the machine's load: the script prints `uptime` before each one.
set -euo pipefail
cd "$(dirname "$0")/.."
unset OPENBLAS_NUM_THREADS OMP_NUM_THREADS MKL_NUM_THREADS BLIS_NUM_THREADS
PY=${PYTHON:-python}
load() { echo "-- $(uptime | sed 's/.*load/load/'); $(nproc) CPUs"; }
short_iters() { grep -E "iter/s|Test net output #0|cpu " | sed -E 's/^I[0-9 :.]+ +[0-9]+ [a-z_]+\.py:[0-9]+\] //'; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed -e 's/max_iter: 10000/max_iter: 300/' -e 's/test_interval: 500/test_interval: 300/' \
    -e 's/test_iter: 100/test_iter: 20/' -e "s#snapshot_prefix: \"examples/mnist/lenet\"#snapshot_prefix: \"$tmp/lenet\"#" \
    -e 's/solver_mode: GPU/solver_mode: CPU/' examples/mnist/lenet_solver.prototxt > "$tmp/short.prototxt"

echo "== the LeNet recipe shortened to 300 iterations (docs/solvers.md, docs/cli.md)"; load
/usr/bin/time -o "$tmp/short.time" -f "cpu %U s user %S s sys, wall %e s" $PY -m minicaffe \
    train --solver "$tmp/short.prototxt" 2> "$tmp/short.log" || true
short_iters < "$tmp/short.log"; cat "$tmp/short.time"
echo "lines on stderr: $(wc -l < "$tmp/short.log") (the default); $($PY -m minicaffe train \
    --solver "$tmp/short.prototxt" --quiet 2>&1 | wc -l) (--quiet)"

echo "== minicaffe time, LeNet batch 64, 10 iterations (docs/cli.md)"; load
$PY -m minicaffe time --model examples/mnist/lenet_train_test.prototxt --iterations 10 2>&1 | \
    grep -E "forward:|backward:|Average|Total" | sed -E 's/^I[0-9 :.]+ +[0-9]+ cli\.py:[0-9]+\] //'

echo "== minicaffe test, BVLC LeNet weights, 10,000 MNIST test images (docs/cli.md)"; load
/usr/bin/time -f "wall %e s" $PY -m minicaffe test --model examples/mnist/lenet_train_test.prototxt \
    --weights tests/data/caffe/lenet_v2_iter_10000.caffemodel --iterations 100 --quiet

if [[ " $* " == *" --load "* ]]; then
  for busy in 0 3; do
    pids=()
    for _ in $(seq 1 $busy); do $PY -c "while True: pass" & pids+=($!); done
    sleep 1
    echo "== examples/mnist/train_lenet.py --max_iter 300, $busy busy processes beside it"; load
    for threads in 1 2; do
      echo "-- --threads $threads"
      /usr/bin/time -f "cpu %U s user %S s sys, wall %e s" $PY examples/mnist/train_lenet.py \
          --max_iter 300 --quiet --threads $threads 2>&1 | short_iters
    done
    for p in "${pids[@]}"; do kill "$p"; done
  done
fi

if [[ " $* " == *" --recipe "* ]]; then
  echo "== the whole recipe: python examples/mnist/train_lenet.py (README)"; load
  /usr/bin/time -f "cpu %U s user %S s sys, wall %e s" $PY examples/mnist/train_lenet.py --quiet \
      2>&1 | grep -E "Iteration 10000|Test net output #0|cpu " | tail -n 3
fi
