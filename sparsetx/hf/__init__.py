"""The Hugging Face layout: export of a trained model and import back (export.py), the GPT-NeoX mapping
(neox.py), the custom mapping (custom.py) with its PyTorch modeling files (modeling/), tokenizer files."""
