#!/usr/bin/env bash
# A Slurm wrapper's view of goodput serve: the job's goodput table as CSV, one row per configuration
# (job,gpu_type,num_nodes,num_gpus,goodput,batch_size,local_bsz,accum_steps,...). A job_submit
# plugin or a submit wrapper picks the row it likes, e.g. the best goodput per GPU:
#
#   GOODPUT_SERVER=http://goodput:8470 deploy/slurm-goodput-table.sh cifar10 a100:4x8,t4:8x4
#
# Alternatively `goodput serve --cluster SPEC --export-dir DIR` keeps DIR/<job>.csv current itself.
set -euo pipefail
job="${1:?usage: $0 JOB CLUSTER}"
cluster="${2:?usage: $0 JOB CLUSTER}"
goodput table --server "${GOODPUT_SERVER:-http://127.0.0.1:8470}" --job "$job" --cluster "$cluster" --format csv \
  | awk -F, 'NR == 1 { next } $5 > 0 { per_gpu = $5 / $4; if (per_gpu > best) { best = per_gpu; row = $0 } }
             END { if (row == "") exit 1; print row }'
