"""The backend: real 4D-parallel GPT training in PyTorch that runs the twin's program."""
