"""GGUF files: reading and validating them (file), the shape keys and tensor names llama.cpp reads (shape), their
tensors into torch (tensors), their vocabulary (tokenizer), and `dflash convert` (convert)."""
