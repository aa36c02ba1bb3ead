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

FLAGS=""
if [ $# -gt 0 ]; then printf -v FLAGS ' %q' "$@"; fi   # extra train flags, quoted for the remote shell
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --worker=all --command="
  cd $REPO && .venv/bin/python -m sparsetx.train --config=$CONFIG --workdir=$WORKDIR ${FLAGS}
"
