"""Checkpoints: the orbax items of a step (state, config, data position), their save, restore and keep policy, the
parameter reads and writes of the programs that read a trained model, and the read errors held back until known."""
