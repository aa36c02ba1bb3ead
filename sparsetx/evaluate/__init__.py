"""Evaluation and export of trained models: perplexity, generation, the Hugging Face layout, lm-eval."""
