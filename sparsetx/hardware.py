"""Published per-chip figures of the accelerators a run is sized for (sparsetx/tools/dry_run.py's roofline).

One table, so every estimate uses the same numbers; each figure names where it is published.
Bandwidths are bytes per second and, as vendors publish them for NVLink and ICI, *bidirectional*
(what a chip sends plus what it receives). A ring collective moves data in both directions at once,
so sparsetx/perf/roofline.py uses half of that figure as the rate a chip sends at. DCN figures
are NIC line rates, one direction.

A collective group of at most `fast_domain` chips runs over NVLink (one 8-GPU HGX/DGX node) or ICI
(one TPU slice, as large as a pod); a larger group is paced by the data-center network (DCN).
"""

import dataclasses

TERA = 1e12
GIGA = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  peak_flops: float  # bf16 dense (no structured sparsity) FLOP/s per chip
  hbm_bandwidth: float  # bytes/s per chip
  ici_bandwidth: float | None  # bytes/s per chip, bidirectional: NVLink inside a node, ICI inside a TPU slice
  dcn_bandwidth: float | None  # bytes/s per chip, one direction, between nodes / slices
  fast_domain: int | None  # chips one NVLink node / ICI slice joins (None: interconnect not in the table)
  hbm_bytes: float = 0.0  # HBM capacity per chip (decimal GB as published)
  # A GPU's opt-in shared memory per thread block, bytes (CUDA programming guide, per compute capability: 227 KiB on
  # sm_90, 163 KiB on sm_80); what the device reports as shared_memory_per_block_optin. None off GPU.
  shared_memory_per_block: int | None = None


SM90 = dict(shared_memory_per_block=227 * 1024)  # Hopper
SM80 = dict(shared_memory_per_block=163 * 1024)  # Ampere (A100)

CHIPS = {
  # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense (1,979 with 2:4 sparsity), 3.35 TB/s HBM3,
  # NVLink 4 900 GB/s bidirectional (18 links x 50 GB/s); DGX H100: one ConnectX-7 400 Gb/s NIC per GPU; 80 GB HBM3.
  "h100": Chip("H100 SXM", 989 * TERA, 3.35e12, 900 * GIGA, 400 / 8 * GIGA, fast_domain=8, hbm_bytes=80 * GIGA, **SM90),
  # NVIDIA H200 SXM datasheet: the H100's GH100 die (989 TFLOP/s bf16 dense), 4.8 TB/s HBM3e, NVLink 4
  # 900 GB/s; DGX/HGX H200 keeps one 400 Gb/s ConnectX-7 per GPU; 141 GB HBM3e.
  "h200": Chip("H200 SXM", 989 * TERA, 4.8e12, 900 * GIGA, 400 / 8 * GIGA, fast_domain=8, hbm_bytes=141 * GIGA, **SM90),
  # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, HBM2e 2,765 GB/s, bidirectional ICI 1,200 GB/s
  # per chip (older revisions of the page: 4,800 Gbps = 600 GB/s each way), DCN 50 Gbps per chip;
  # largest slice 6,144 chips; 95 GB of HBM2e per chip.
  "v5p": Chip("TPU v5p", 459 * TERA, 2765 * GIGA, 1200 * GIGA, 50 / 8 * GIGA, fast_domain=6144, hbm_bytes=95 * GIGA),
  # cloud.google.com/tpu/docs/v6e (Trillium): 918 TFLOP/s bf16, HBM 1,640 GB/s (the page also rounds
  # it to 1,600), bidirectional ICI 800 GB/s per chip (older revisions: 3,200 Gbps = 400 GB/s each way),
  # 4 x 200 Gbps NICs per 8-chip host = 100 Gbps per chip; a pod (the largest slice) is 256 chips; 32 GB of HBM.
  "v6e": Chip("TPU v6e", 918 * TERA, 1640 * GIGA, 800 * GIGA, 100 / 8 * GIGA, fast_domain=256, hbm_bytes=32 * GIGA),
  # Chips a run may train on but no --target sizes a run for: the training loop's MFU reads their peak, a dry run
  # on their topology their links. NVIDIA A100 SXM4 datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e (80 GB; the
  # 40 GB part 1,555 GB/s), NVLink 3 600 GB/s bidirectional (12 links x 50 GB/s); DGX A100: one 200 Gb/s HDR
  # ConnectX-6 per GPU. cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 1,200 GB/s, 32 GiB HBM2;
  # .../v5e: 197 TFLOP/s bf16, 819 GB/s, 16 GB HBM2 (their interconnect is not in the table).
  "a100": Chip("A100 SXM 80GB", 312 * TERA, 2039 * GIGA, 600 * GIGA, 200 / 8 * GIGA, 8, 80 * GIGA, **SM80),
  "a100-40gb": Chip("A100 SXM 40GB", 312 * TERA, 1555 * GIGA, 600 * GIGA, 200 / 8 * GIGA, 8, 40 * GIGA, **SM80),
  "v4": Chip("TPU v4", 275 * TERA, 1200 * GIGA, None, None, None, hbm_bytes=32 * 2**30),
  "v5e": Chip("TPU v5e", 197 * TERA, 819 * GIGA, None, None, None, hbm_bytes=16 * GIGA),
}
TARGET_CHIPS = ("h100", "h200", "v5p", "v6e")  # the chips a run is sized for (their interconnect is known)


def chips(target: str) -> list[Chip]:
  """The chips a `--target` names: one key of CHIPS, or 'all'."""
  if target == "all":
    return [CHIPS[name] for name in TARGET_CHIPS]
  if target not in TARGET_CHIPS:
    raise ValueError(f"--target={target} is not a known chip; use one of {', '.join(TARGET_CHIPS)} or all.")
  return [CHIPS[target]]


def chip_of(device_kind: str) -> Chip | None:
  """The CHIPS entry of a `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5p" or "TPU v5", "TPU v6 lite",
  "TPU v5 lite", "NVIDIA A100-SXM4-40GB"), or None for a chip the table does not hold (CPU, ...)."""
  kind = device_kind.lower()
  for name in ("h100", "h200"):
    if name in kind:
      return CHIPS[name]
  if "a100" in kind:
    return CHIPS["a100-40gb" if "40gb" in kind else "a100"]
  tpus = {"tpu v4": "v4", "tpu v5": "v5p", "tpu v5p": "v5p", "tpu v5 lite": "v5e", "tpu v5e": "v5e"}
  tpus |= {"tpu v6 lite": "v6e", "tpu v6e": "v6e"}
  return CHIPS[tpus[kind]] if kind in tpus else None
