"""What a newcomer reads stays short and true: the dry run's parameter count is not rounded to zero, the local
launcher does not relay Gloo's line per connected pair, and W&B neither warns about `resume` offline nor prints a
summary of its own."""

import io
import types

from sparsetx.measure import aot
from sparsetx.tools import launch_local
from sparsetx.train.tracking import wandb_writer


def test_the_dry_runs_parameter_count_reads_in_millions():
  memory = dict(argument=1, output=1, alias=0, temp=1, generated_code=0, host_temp=0)
  report = aot.Report({"data": 1}, 4_686_976, 1, 1, 1, memory, 1.0, 1.0, [])
  (line,) = [line for line in aot.format_report(report).splitlines() if line.startswith("parameters")]
  assert line.endswith("4,686,976 (4.69 M)"), line  # not "(0.00 B)"


def test_the_launcher_does_not_relay_gloos_connection_lines(capsys):
  output = (
    b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    b"step 1/2  loss 4.1\n"
    b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    b"[Gloo] something else\n"
  )
  launch_local.relay(io.BytesIO(output), "[0] ")
  assert capsys.readouterr().out == "[0] step 1/2  loss 4.1\n[0] [Gloo] something else\n"


def test_wandb_starts_quietly_and_resumes_only_online(tmp_path, monkeypatch):
  import wandb

  started = []
  monkeypatch.setattr(wandb, "init", lambda **kwargs: started.append(kwargs) or types.SimpleNamespace(step=0))
  for mode in ("offline", "online"):
    settings = types.SimpleNamespace(project="p", entity="", name="", mode=mode)
    wandb_writer.WandbWriter(settings, tmp_path)
  assert [kwargs["resume"] for kwargs in started] == [None, "allow"]  # offline ignores resume, with a warning
  assert all(kwargs["settings"].quiet for kwargs in started)
