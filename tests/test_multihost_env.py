"""Environment detection for multi-host start-up, on recorded SLURM, JobSet and flag environments."""

import re

import pytest

from sparsetx.config import ConfigError
from sparsetx.parallel import distributed

# From `srun env` in a 2-node job with one task per GPU (--ntasks-per-node=8 --gpus-per-node=8), task 11.
SLURM_PER_GPU = {
  "SLURM_JOB_ID": "418807",
  "SLURM_JOB_NAME": "sparsetx",
  "SLURM_JOB_NODELIST": "h100-[017-018]",
  "SLURM_JOB_NUM_NODES": "2",
  "SLURM_NNODES": "2",
  "SLURM_NTASKS": "16",
  "SLURM_NPROCS": "16",
  "SLURM_PROCID": "11",
  "SLURM_LOCALID": "3",
  "SLURM_NODEID": "1",
  "SLURM_STEP_ID": "0",
  "SLURM_STEP_NODELIST": "h100-[017-018]",
  "SLURM_STEP_NUM_NODES": "2",
  "SLURM_STEP_NUM_TASKS": "16",
  "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
  "SLURM_TASKS_PER_NODE": "8(x2)",
  "SLURMD_NODENAME": "h100-018",
  "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}
# The same cluster, one task per node (--ntasks-per-node=1), task 1 on the second node of three.
SLURM_PER_NODE = {
  "SLURM_JOB_ID": "418810",
  "SLURM_JOB_NODELIST": "gpu-a[7,9-10]",
  "SLURM_NTASKS": "3",
  "SLURM_PROCID": "1",
  "SLURM_LOCALID": "0",
  "SLURM_STEP_NODELIST": "gpu-a[7,9-10]",
  "SLURM_STEP_NUM_NODES": "3",
  "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}
# A pod of deploy/k8s/jobset.yaml with 2 jobs of 4 pods (TPU-style), job 1, pod 2.
JOBSET = {
  "JOBSET_NAME": "sparsetx",
  "REPLICATED_JOB_NAME": "workers",
  "JOB_INDEX": "1",
  "JOB_COMPLETION_INDEX": "2",
  "JOBSET_REPLICAS": "2",
  "PODS_PER_JOB": "4",
  "HOSTNAME": "sparsetx-workers-1-2",
  "KUBERNETES_SERVICE_HOST": "10.0.0.1",
}


def test_slurm_one_task_per_gpu():
  spec = distributed.detect(SLURM_PER_GPU)
  port = distributed.SLURM_PORT_BASE + 418807 % distributed.SLURM_PORT_SPAN
  assert spec == distributed.Spec("slurm", f"h100-017:{port}", 16, 11, (3,))


def test_slurm_one_task_per_node_uses_all_its_gpus():
  spec = distributed.detect(SLURM_PER_NODE)
  assert (spec.coordinator_address.split(":")[0], spec.num_processes, spec.process_id) == ("gpu-a7", 3, 1)
  assert spec.local_device_ids is None


def test_slurm_gpu_bound_per_task_keeps_its_one_visible_gpu():
  spec = distributed.detect(dict(SLURM_PER_GPU, CUDA_VISIBLE_DEVICES="3"))  # --gpus-per-task=1
  assert spec.local_device_ids is None


@pytest.mark.parametrize(
  "nodelist, first",
  [
    ("node001", "node001"),
    ("node001,login2", "node001"),
    ("h100-[017-018,020]", "h100-017"),
    ("rack[3-4]-gpu[08-09],spare1", "rack3-gpu08"),
    ("a[10],b7", "a10"),
  ],
)
def test_first_host_of_a_slurm_hostlist(nodelist, first):
  assert distributed.first_host(nodelist) == first


def test_jobset_pod():
  spec = distributed.detect(JOBSET)
  assert spec == distributed.Spec("kubernetes", "sparsetx-workers-0-0.sparsetx:8476", 8, 6)


def test_explicit_flags_override_every_environment():
  for env in ({}, SLURM_PER_GPU, JOBSET):
    spec = distributed.detect(env, coordinator_address="10.1.2.3:1234", num_processes=4, process_id=2)
    assert (spec.source, spec.coordinator_address, spec.num_processes, spec.process_id) == (
      "flags",
      "10.1.2.3:1234",
      4,
      2,
    )


def test_one_flag_overrides_one_detected_field():
  spec = distributed.detect(SLURM_PER_GPU, coordinator_address="h100-018:7777", local_device_ids=[0, 1])
  assert spec == distributed.Spec("slurm + flags", "h100-018:7777", 16, 11, (0, 1))


def test_tpu_vm_is_left_to_jax_and_no_environment_is_one_process():
  assert distributed.detect({}, tpu_present=True) == distributed.Spec("tpu")
  assert distributed.detect({"TPU_WORKER_HOSTNAMES": "t1,t2"}) == distributed.Spec("tpu")
  assert not distributed.detect({"HOME": "/root"}).multi_process


@pytest.mark.parametrize(
  "flags, message",
  [
    (dict(coordinator_address="localhost:1234"), "missing --num_processes, --process_id"),
    (
      dict(coordinator_address="localhost:1234", num_processes=2, process_id=2),
      "--process_id=2 must be in [0, --num_processes=2)",
    ),
    (
      dict(coordinator_address="localhost", num_processes=2, process_id=0),
      "--coordinator_address=localhost has no port",
    ),
  ],
)
def test_incomplete_or_inconsistent_flags_are_one_line_errors(flags, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    distributed.detect({}, **flags)
