"""A checkpoint's weights, as tensors: safetensors files or a GGUF file (dequantized), and
``tollway convert`` (GGUF to a Hugging Face directory)."""
