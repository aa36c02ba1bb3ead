"""Evaluation of trained models: perplexity, generation, scoring, the lm-eval adapter."""
