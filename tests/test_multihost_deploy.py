"""The deploy recipes parse and start the entry point the README documents."""

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

ENTRY = "-m sparsetx.train"


def test_readmes_name_the_entry_point():
  assert f"python {ENTRY} --config=" in (REPO / "deploy/README.md").read_text()
  assert f"python {ENTRY} --config=" in (REPO / "README.md").read_text()


def test_shell_scripts_parse_and_run_the_entry_point():
  for script in ("deploy/slurm/train.sbatch", "deploy/tpu/run_pod.sh"):
    path = REPO / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, f"{script}: {result.stderr}"
    text = path.read_text()
    assert re.search(r'python"? ' + re.escape(ENTRY) + " --config=", text.replace("$PYTHON", "python")), script


def test_sbatch_asks_for_8_gpus_per_node_and_srun_starts_every_task():
  text = (REPO / "deploy/slurm/train.sbatch").read_text()
  directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  assert directives["gpus-per-node"] == "8" and int(directives["nodes"]) > 1
  assert re.search(r"^\s*srun .*\\$", text, re.M)


def test_sbatch_runs_one_process_per_node_with_its_target_recipe():
  """One task per node keeps the ICI `expert` axis inside the node's NVLink; the default config is the ladder
  recipe for the nodes asked for (its DCN data axis is the node count)."""
  from conftest import load_config

  text = (REPO / "deploy/slurm/train.sbatch").read_text()
  directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
  assert directives["ntasks-per-node"] == "1"
  path, arg = re.search(r"^CONFIG=\$\{CONFIG:-(.*?):(.*)\}$", text, re.M).groups()
  config = load_config(path, arg)
  assert config.mesh.dcn.data == int(directives["nodes"]) and config.mesh.ici.expert == 8


def test_jobset_loads_and_sets_the_environment_detection_reads():
  documents = list(yaml.safe_load_all((REPO / "deploy/k8s/jobset.yaml").read_text()))
  assert len(documents) == 1 and documents[0]["kind"] == "JobSet"
  job = documents[0]["spec"]["replicatedJobs"][0]
  container = job["template"]["spec"]["template"]["spec"]["containers"][0]
  assert shlex.join(container["command"]) == f"python {ENTRY}"
  assert any(arg.startswith("--config=") for arg in container["args"])
  env = {e["name"]: e.get("value") for e in container["env"]}
  assert {"JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX"} <= set(env)
  assert int(env["JOBSET_REPLICAS"]) == job["replicas"]
  assert int(env["PODS_PER_JOB"]) == job["template"]["spec"]["parallelism"]


# MaxText's H100 flags (end_to_end/gpu/a3/test_llama2_7b.sh; its --xla_gpu_graph_level=0 is spelled
# --xla_gpu_enable_command_buffer= since XLA dropped the former) and its TPU LIBTPU_INIT_ARGS.
MAXTEXT_GPU_FLAGS = [
  "--xla_gpu_enable_latency_hiding_scheduler=true",
  "--xla_gpu_enable_triton_gemm=false",
  "--xla_gpu_enable_command_buffer=",
  "--xla_gpu_enable_highest_priority_async_stream=true",
  "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
  "--xla_gpu_enable_pipelined_all_gather=true",
  "--xla_gpu_enable_pipelined_reduce_scatter=true",
  "--xla_gpu_enable_pipelined_all_reduce=true",
  "--xla_gpu_enable_while_loop_double_buffering=true",
  "--xla_gpu_enable_all_gather_combine_by_dim=false",
  "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
  "--xla_disable_hlo_passes=rematerialization",
]
MAXTEXT_TPU_FLAGS = [
  "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
  "--xla_tpu_data_parallel_opt_different_sized_ops=true",
  "--xla_tpu_enable_async_collective_fusion=true",
  "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
  "--xla_tpu_overlap_compute_collective_tc=true",
  "--xla_enable_async_all_gather=true",
]


def _flags(text: str) -> list:
  return re.findall(r"--xla_\w+=[^\s\"\\]*", text)


def test_recipes_set_the_maxtext_xla_flags_and_the_pinned_jaxlib_accepts_them():
  sbatch = re.search(r'^export XLA_FLAGS="(.*?)"$', (REPO / "deploy/slurm/train.sbatch").read_text(), re.M | re.S)
  assert sbatch and _flags(sbatch[1]) == MAXTEXT_GPU_FLAGS
  (jobset,) = yaml.safe_load_all((REPO / "deploy/k8s/jobset.yaml").read_text())
  env = {
    e["name"]: e.get("value")
    for e in jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
  }
  assert env["XLA_FLAGS"].split() == MAXTEXT_GPU_FLAGS
  pod = (REPO / "deploy/tpu/run_pod.sh").read_text()
  tpu = re.search(r'^LIBTPU_INIT_ARGS=\$\{LIBTPU_INIT_ARGS:-"(.*?)"\}$', pod, re.M | re.S)
  assert tpu and _flags(tpu[1]) == MAXTEXT_TPU_FLAGS and "LIBTPU_INIT_ARGS='$LIBTPU_INIT_ARGS'" in pod
  # XLA aborts on a flag it does not know: the GPU flags parse in this jaxlib, a made-up one does not.
  probe = [sys.executable, "-c", "import jax; jax.devices()"]
  for flags, ok in ((MAXTEXT_GPU_FLAGS, True), (["--xla_gpu_no_such_flag=true"], False)):
    result = subprocess.run(
      probe,
      env={**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"},
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert (result.returncode == 0) == ok, result.stderr[-500:]


FAKE_SRUN = r"""#!/bin/bash
# SLURM's srun, simulated: its options dropped, the command started as 2 tasks of 2 nodes on this machine.
while [[ "$1" == --* ]]; do shift; done
pids=()
for i in 0 1; do
  SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=2 SLURM_STEP_NUM_NODES=2 SLURM_STEP_NODELIST=localhost \
    "$@" > "$SRUN_LOGS/task_$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
@pytest.mark.long
def test_sbatch_script_tokenizes_then_trains_under_a_simulated_slurm(tmp_path):
  """The sbatch script as written, with SLURM's environment simulated: its tokenize step writes the corpus of the
  config (the embedded one), then srun's 2 tasks (2 CPU devices each, gloo) train from it to the last step and
  checkpoint; run again, the tokenize step finds the corpus complete and the tasks resume from that checkpoint."""
  from conftest import MICRO_TRAIN_FLAGS

  bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
  bin_dir.mkdir()
  logs.mkdir()
  (bin_dir / "srun").write_text(FAKE_SRUN)
  (bin_dir / "srun").chmod(0o755)
  env = {
    **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    "PATH": f"{bin_dir}:{os.environ['PATH']}",
    "SRUN_LOGS": str(logs),
    "SLURM_SUBMIT_DIR": str(REPO),
    "SLURM_JOB_NAME": "sparsetx",
    "SLURM_JOB_ID": str(4096 + os.getpid() % 4096),  # the coordinator's port comes from it
    "SLURM_CPUS_PER_TASK": "1",
    "PYTHON": sys.executable,
    "CONFIG": "configs/tiny.py:mlp",
    "WORKDIR": str(tmp_path / "run"),
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
  }
  flags = [
    *MICRO_TRAIN_FLAGS,
    "--config.data.mixture=(('facts', 1.0),)",
    "--config.train.eval_every=1000",
    "--config.checkpoint.every=2",
    "--config.train.accept_schedule_change=True",  # the second run, 4 steps, extends the first
  ]
  for steps in (2, 4):
    result = subprocess.run(
      ["bash", str(REPO / "deploy/slurm/train.sbatch"), *flags, f"--config.train.steps={steps}"],
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
    )
    tasks = "\n".join(
      (logs / f"task_{i}.log").read_text()[-1500:] for i in range(2) if (logs / f"task_{i}.log").exists()
    )
    assert result.returncode == 0, result.stderr[-2000:] + tasks
    assert (tmp_path / "run/tokenized/manifest.json").exists()
    assert str(steps) in os.listdir(tmp_path / "run/checkpoints"), os.listdir(tmp_path / "run")
    resumed = ["Resumed from" in (logs / f"task_{i}.log").read_text() and "at step 2." in tasks for i in range(2)]
    assert resumed == [steps == 4] * 2, tasks


def test_the_jobset_image_is_built_by_the_dockerfile_with_an_extra_pyproject_has():
  """deploy/Dockerfile builds what the JobSet runs: an extra pyproject.toml defines, its Python within
  requires-python, every path the image needs copied, and the JobSet's `python` the image's .venv."""
  import tomllib  # noqa: PLC0415

  dockerfile = (REPO / "deploy/Dockerfile").read_text()
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  extra = re.search(r"^ARG EXTRA=(\S+)$", dockerfile, re.M).group(1)
  assert extra in project["optional-dependencies"] and extra.startswith("cuda")
  for name in re.findall(r"EXTRA=(\w+)", (REPO / "deploy/README.md").read_text()):
    assert name in project["optional-dependencies"], name
  version = re.search(r"^FROM python:(\d+)\.(\d+)", dockerfile, re.M).groups()
  assert project["requires-python"] == ">=3.12,<3.14" and version in (("3", "12"), ("3", "13"))
  copied = re.findall(r"^COPY (.+) \S+$", dockerfile, re.M)
  needed = {"pyproject.toml", "README.md", "sparsetx", "configs"}  # the package, its readme, the configs it runs
  assert needed <= {word for line in copied for word in line.split()}, copied
  assert 'pip install --no-cache-dir -e ".[${EXTRA}]"' in dockerfile
  assert "ENV PATH=/sparsetx/.venv/bin:$PATH" in dockerfile
  (jobset,) = yaml.safe_load_all((REPO / "deploy/k8s/jobset.yaml").read_text())
  container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
  assert container["command"][0] == "python" and container["image"].endswith("/sparsetx:latest")
  config = next(arg for arg in container["args"] if arg.startswith("--config="))[len("--config=") :]
  assert (REPO / config.split(":")[0]).exists()  # the config the image runs is in the image
