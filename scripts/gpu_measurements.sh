#!/usr/bin/env bash
# The measurements a lent GPU owes (docs/measurements.md, "On the next GPU"), in parts that each fit one device call
# of at most 10 minutes, on an image that has JAX, flax, optax and orbax but not the rest of the install:
#
#   scripts/gpu_measurements.sh deps                  here: the missing pure-Python packages into .device_deps/
#   scripts/gpu_measurements.sh check|autotune|scale4|parts|head|remat|scale8   there, from the repository root (carry .device_deps)
#   SMALL=1 scripts/gpu_measurements.sh check|...     rehearsal on a CPU: the same programs at --small shapes
#
# Each part writes its log to $OUT/<part>.log (and prints its tail); JAX_COMPILATION_CACHE_DIR lets a rerun on the
# warm machine skip the compiles. Nothing here needs seqio, TensorFlow or the data path. The script exits 1 when any
# program of the part failed or ran out of time (naming them on its last line), 0 when all of them ran to rc=0.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?"say which part: deps, check, autotune, scale4, parts, head, remat or scale8"}
OUT=${OUT:-/tmp/sparsetx-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.device_deps${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/sparsetx-jax-cache}
PY=${PY:-python3}
small=()
[[ ${SMALL:-0} == 1 ]] && small=(--small)

failed=()
run() {  # run NAME SECONDS COMMAND...: the command under a time limit, its log kept whatever it returns
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc" >>"$OUT/$name.log"
  tail -n 30 "$OUT/$name.log"
  ((rc == 0)) || failed+=("$name (rc=$rc$( ((rc == 124)) && echo ", out of time"))")
}

case $part in
  deps)  # the device image lacks these (ml-collections needs PyYAML); Python 3.12 on x86_64, as the image has
    rm -rf .device_deps && mkdir -p .device_deps/wheels
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      -d .device_deps/wheels ml-collections pyyaml || exit 1
    for wheel in .device_deps/wheels/*.whl; do "$PY" -m zipfile -e "$wheel" .device_deps; done
    rm -rf .device_deps/wheels
    ;;
  check)  # the acceptance check: every kernel row, each backend, the kernel bench and the train steps
    "$PY" -c "import jax; print(jax.__version__, jax.devices())" || failed+=("jax import")
    run accelerator_check 540 "$PY" -m sparsetx.tools.accelerator_check "${small[@]}"
    ;;
  autotune)  # the device's own choice per op and shape class at issue 42's shape, the table kept under $OUT
    export SPARSETX_AUTOTUNE_TABLE=$OUT/autotune.json
    for type in sgatlin peer moe; do
      config=(--config="configs/ladder.py:$type,4" --config.data.global_batch_size=16 --config.data.seq_len=1024
        --config.model.dtype=bfloat16 --config.mesh.ici.data=1)
      # the rehearsal: XLA only (the Triton interpreter would take minutes)
      [[ ${SMALL:-0} == 1 ]] && config=(--config=configs/tiny.py:"$type" --config.data.global_batch_size=8 --implementations=xla)
      run "autotune_$type" 180 "$PY" -m sparsetx.tools.autotune "${config[@]}" --rounds=5
    done
    ;;
  scale4)  # issue 42's shape: scale 4, 16 x 1,024 tokens, bf16; the Triton rows, then the Mosaic ones
    shape=(--scale=4 --batch=16 --seq_len=1024 --rounds=3)
    [[ ${SMALL:-0} == 1 ]] && shape=(--small --rounds=1)
    run scale4_triton 300 "$PY" -m sparsetx.tools.bench_train_step "${shape[@]}" --types=mlp,sgatlin,peer,fff \
      --implementation=triton
    run scale4_mosaic 240 "$PY" -m sparsetx.tools.bench_train_step "${shape[@]}" --types=mlp,sgatlin,peer \
      --implementation=mosaic
    ;;
  parts)  # where the step's time goes at that shape (a jax.profiler trace per type)
    shape=(--scale=4 --batch=16 --seq_len=1024 --rounds=2)
    [[ ${SMALL:-0} == 1 ]] && shape=(--small --rounds=1)
    run parts_scale4 480 "$PY" -m sparsetx.tools.bench_step_parts "${shape[@]}" --types=mlp,sgatlin,peer \
      --implementation=triton
    ;;
  head)  # the same shape with the LM head's dot on bf16 operands over the whole vocabulary (docs/measurements.md)
    shape=(--scale=4 --batch=16 --seq_len=1024 --rounds=3)
    [[ ${SMALL:-0} == 1 ]] && shape=(--small --rounds=1)
    run head_scale4 300 "$PY" -m sparsetx.tools.bench_train_step "${shape[@]}" --types=mlp,sgatlin --implementation=triton \
      --nologits_dot_in_fp32 --loss_chunks=0
    ;;
  remat)  # the ladder's remat=full, beside the default the H200 ran (remat none)
    shape=(--scale=4 --batch=16 --seq_len=1024 --rounds=3)
    [[ ${SMALL:-0} == 1 ]] && shape=(--small --rounds=1)
    run remat_full 300 "$PY" -m sparsetx.tools.bench_train_step "${shape[@]}" --types=mlp,sgatlin --implementation=triton \
      --remat=full
    ;;
  scale8)  # the dense baseline's MFU at scale 8 (d_model 1,024, 16 layers, 16 x 2,048), then sgatlin alone: its
    # 6.8 B parameters with AdamW state and gradients take about 121 GB before activations, so it may not fit
    shape=(--scale=8 --batch=16 --seq_len=2048 --rounds=3)
    [[ ${SMALL:-0} == 1 ]] && shape=(--small --rounds=1)
    run scale8_mlp 240 "$PY" -m sparsetx.tools.bench_train_step "${shape[@]}" --types=mlp
    run scale8_sgatlin 300 "$PY" -m sparsetx.tools.bench_train_step "${shape[@]}" --types=sgatlin --implementation=triton
    ;;
  *)
    echo "no part '$part': use deps, check, autotune, scale4, parts, head, remat or scale8" >&2
    exit 2
    ;;
esac
if ((${#failed[@]})); then
  joined=$(printf '%s; ' "${failed[@]}")
  echo "gpu_measurements.sh $part: failed: ${joined%; } (logs in $OUT)" >&2
  exit 1
fi
