#!/bin/bash
# sparsetx on every worker of a Cloud TPU VM pod slice:
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a WORKDIR=/mnt/shared/run1 deploy/tpu/run_pod.sh [--config.X=...]
#
# Each worker runs the same command; JAX reads the pod's topology from the TPU metadata (process
# id, count, coordinator), so no distributed flags are passed. A single pod slice is one DCN slice,
# and the default mesh (config.mesh.dcn.data=-1) gives it a DCN of size 1; several slices become
# DCN data replicas.
set -euo pipefail

TPU_NAME=${TPU_NAME:?set TPU_NAME to the TPU VM name}
ZONE=${ZONE:?set ZONE to the TPU VM zone}
PROJECT=${PROJECT:-$(gcloud config get-value project 2>/dev/null)}
REPO=${REPO:-\$HOME/sparsetx}                          # the checkout on each worker (see deploy/README.md)
CONFIG=${CONFIG:-configs/ladder.py:sgatlin,4}
WORKDIR=${WORKDIR:?set WORKDIR to a directory every worker shares (NFS / Filestore / gcsfuse mount)}
TOKENIZED_DIR=${TOKENIZED_DIR:-$WORKDIR/tokenized}      # shared too: the corpus CONFIG's data is tokenized into

# The libtpu flags MaxText trains with: asynchronous, fused collectives overlapped with compute and the
# data-parallel all-reduce optimization. LIBTPU_INIT_ARGS set here before the call replaces them.
LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS:-"--xla_tpu_enable_data_parallel_all_reduce_opt=true \
 --xla_tpu_data_parallel_opt_different_sized_ops=true \
 --xla_tpu_enable_async_collective_fusion=true \
 --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true \
 --xla_tpu_enable_async_collective_fusion_multiple_steps=true \
 --xla_tpu_overlap_compute_collective_tc=true \
 --xla_enable_async_all_gather=true"}

FLAGS=""
CONFIG_FLAGS=""
if [ $# -gt 0 ]; then printf -v FLAGS ' %q' "$@"; fi   # extra train flags, quoted for the remote shell
for arg in "$@"; do
  case "$arg" in --config.*) printf -v CONFIG_FLAGS '%s %q' "$CONFIG_FLAGS" "$arg" ;; esac
done
# The corpus the run trains on, tokenized on worker 0's CPUs before training starts on any worker:
# sparsetx-tokenize finishes a partial corpus and checks a complete one against CONFIG in seconds; a corpus of
# another config there is one error line, and nothing is launched.
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=0 --command="
  cd $REPO && JAX_PLATFORMS=cpu .venv/bin/python -m sparsetx.tools.tokenize --config=$CONFIG --output_dir=$TOKENIZED_DIR ${CONFIG_FLAGS}
"
# A hang ends every worker that can still speak with the watchdog's code, 6 (sparsetx/train/run/watchdog.py): the run
# starts again and resumes from the newest checkpoint, up to RESTARTS times (default 3); any other code ends here.
restarts=${RESTARTS:-3}
while true; do
  code=0
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all --command="
    cd $REPO && LIBTPU_INIT_ARGS='$LIBTPU_INIT_ARGS' .venv/bin/python -m sparsetx.train --config=$CONFIG \
      --workdir=$WORKDIR --config.data.tokenized_dir=$TOKENIZED_DIR ${FLAGS}
  " || code=$?
  if [ "$code" -ne 6 ] || [ "$restarts" -le 0 ]; then exit "$code"; fi
  restarts=$((restarts - 1))
  echo "sparsetx: the hang watchdog ended the run (exit 6); restarting it, $restarts restarts left" >&2
done
