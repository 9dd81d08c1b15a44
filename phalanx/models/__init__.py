"""Models: the Llama family and MoE decoders, tensor-parallel layers, weight loaders."""
