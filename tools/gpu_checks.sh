#!/usr/bin/env bash
# The GPU checks, run on a GPU machine from the repository root:
#
#   bash tools/gpu_checks.sh OUTDIR [MNIST_DIR] [steps...]
#
# steps (default: all): tests lenet datawait time
#   tests     every test marked gpu / multi_gpu
#   lenet     examples/mnist/train_lenet.py --gpu 0: Caffe's LeNet recipe, 10,000 iterations
#   datawait  benchmarks/data_wait_gpu.py: how long the compute stream waits for data
#   time      minicaffe time on LeNet (TRAIN, from LMDB) and CIFAR-10 quick (deploy)
#   scaling   benchmarks/multi_gpu_scaling.py: images/s on 1, 2, 4 GPUs, threads and processes
#   lenetall  Caffe's LeNet recipe (10,000 iterations) with --gpu all (several GPUs)
#   bench     minicaffe bench --compare torch on the five reference nets, strict fp32, then
#             the three large ones with --tf32; one JSON per run in OUTDIR/bench, all of
#             them in OUTDIR/bench_all.json
# Logs go to OUTDIR; the last lines of each step are printed.
set -u
OUT=${1:-out}
MNIST=${2:-}
shift $(( $# >= 2 ? 2 : $# ))
STEPS=${*:-tests lenet datawait time}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -n "$MNIST" ] && export MINICAFFE_MNIST_DIR="$MNIST"
for step in $STEPS; do
  echo "== $step"
  case $step in
    tests)
      python3 -m pytest -q -m "gpu or multi_gpu" -p no:cacheprovider tests >"$OUT/gpu_tests.log" 2>&1
      tail -25 "$OUT/gpu_tests.log";;
    lenet)
      /usr/bin/time -f "wall %e s" python3 examples/mnist/train_lenet.py --gpu 0 \
        --log "$OUT/lenet_gpu.log" >"$OUT/lenet_gpu.out" 2>&1
      tail -3 "$OUT/lenet_gpu.out"; grep "Test net output" "$OUT/lenet_gpu.log" | tail -2;;
    datawait)
      python3 benchmarks/data_wait_gpu.py ${MNIST:+--mnist "$MNIST"} --iters 2000 \
        >"$OUT/datawait.log" 2>&1; tail -8 "$OUT/datawait.log";;
    time)
      python3 -m minicaffe time --model examples/mnist/lenet_train_test.prototxt --gpu 0 \
        --iterations 200 >"$OUT/time_lenet.log" 2>&1; grep -E "Average|Total" "$OUT/time_lenet.log"
      python3 tools/dummy_data_net.py examples/cifar10/cifar10_quick_train_test.prototxt \
        "$OUT/cifar10_quick_dummy.prototxt" 100,3,32,32
      python3 -m minicaffe time --model "$OUT/cifar10_quick_dummy.prototxt" --gpu 0 \
        --iterations 200 >"$OUT/time_cifar.log" 2>&1; grep -E "Average|Total" "$OUT/time_cifar.log";;
    scaling)
      python3 benchmarks/multi_gpu_scaling.py --out "$OUT/scaling" >"$OUT/scaling.md" 2>"$OUT/scaling.err"
      cat "$OUT/scaling.md"; tail -3 "$OUT/scaling.err";;
    lenetall)
      /usr/bin/time -f "wall %e s" python3 examples/mnist/train_lenet.py --gpu all \
        --log "$OUT/lenet_all.log" >"$OUT/lenet_all.out" 2>&1
      tail -3 "$OUT/lenet_all.out"; grep -E "Test net output|P2PManager: total" "$OUT/lenet_all.log" | tail -3;;
    bench)
      mkdir -p "$OUT/bench"
      for spec in lenet:64:100 cifar10_quick:100:100 bvlc_alexnet:128:20 vgg16:64:10 resnet50:64:10; do
        IFS=: read -r m b it <<<"$spec"
        python3 -m minicaffe bench --gpu 0 --model "models/$m/train_val.prototxt" --batch "$b" \
          --iterations "$it" --compare torch --json "$OUT/bench/$m.json" >"$OUT/bench/$m.txt" 2>&1
        tail -4 "$OUT/bench/$m.txt"
      done
      for spec in bvlc_alexnet:128:20 vgg16:64:10 resnet50:64:10; do
        IFS=: read -r m b it <<<"$spec"
        python3 -m minicaffe bench --gpu 0 --model "models/$m/train_val.prototxt" --batch "$b" \
          --iterations "$it" --compare torch --tf32 --json "$OUT/bench/${m}_tf32.json" \
          >"$OUT/bench/${m}_tf32.txt" 2>&1
        tail -4 "$OUT/bench/${m}_tf32.txt"
      done
      python3 -c "import json,glob,sys; json.dump({f: json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + '/bench/*.json'))}, open(sys.argv[1] + '/bench_all.json', 'w'), indent=1)" "$OUT";;
  esac
done
