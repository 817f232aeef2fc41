"""What runs the model (vLLM's model_executor and v1/worker): the model runner, attention
backends (torch on the CPU, Triton on the GPU), CUDA graphs, tensor parallelism, weight and
tokenizer loading, LoRA, sleep mode's memory, and the model architectures (`models/`)."""
