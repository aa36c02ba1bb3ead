"""The deploy recipes parse and start the entry point the README documents."""

import re
import shlex
import subprocess

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
  assert re.search(r"^srun .*\\$", text, re.M)


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
