"""The command-line programs, the top layer: each module is one program with a `main()` entry point.

pyproject.toml's [project.scripts] names them (`sparsetx-dry-run` is `sparsetx.tools.dry_run:main`), and each
runs as `python -m sparsetx.tools.NAME` too. Programs take absl flags and end a bad input with one `error:` line
and exit code 2 (sparsetx/cli.py); lm_eval_cli is lm-eval's own command line. The benchmarks are the
bench_*.py programs: they print a table of ratios measured side by side and some write a PNG.

Loading a program sets up its console first (cli.quiet_console): TensorFlow prints its start-up notices when it is
imported, which the programs' own imports do.
"""

from sparsetx import cli

cli.quiet_console()
