"""The backend: real 4D-parallel GPT and Llama training in PyTorch that runs the twin's program.

Its subpackages: `runtime` runs a program on one rank (the executor, the kernels of its compute ops in
layers, its collectives in comm, the process groups in dist, GEMM layout tuning, the op recorder,
sharded checkpoints and the memory peak);
`models` holds the 4D models whose shards the executor runs (gpt, llama built on it, build's
`make_model` that picks one by spec), the single-process reference GPT and decoding from a checkpoint;
`training` the training loop, the training step, data, the goldfish loss, held-out
evaluation and fine-tuning; `launch` starts the ranks (spawned here, or one rank under torchrun or
srun); `bench` the microbenchmarks and recorded steps that calibrate the twin, and replay; `hf` reads
and writes Hugging Face Llama checkpoints; `studies` the memorization study and its extraction test;
`cli` the `backend` command. Imports between them run one way: runtime <- models <- hf <- training
<- {bench, studies} <- cli (launch beside them, used by training, bench and cli).
"""
