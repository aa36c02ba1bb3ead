"""Interpretability: standard names for the values inside a model, trace/patch, and sparse-circuit tools.

names.py (the registry), trace.py (trace, patch, logit lens), printout.py (the model by its names),
checkpoint.py (load a trained model, prompts, validation rows), circuits.py (gate vectors and FFF
paths as sparse circuits, the circuit database), neighbours.py, embedding.py, nie.py (causal
patching), usage.py (neuron usage, coactivation, FFF visits), pruning.py (FFF node pruning).
"""

from sparsetx.interp.names import REGISTRY, layout_shape, resolve, served_names
from sparsetx.interp.trace import FromRun, Patch, StandardizedTransformer, gate_vector

__all__ = [
  "REGISTRY",
  "layout_shape",
  "resolve",
  "served_names",
  "FromRun",
  "Patch",
  "StandardizedTransformer",
  "gate_vector",
]
