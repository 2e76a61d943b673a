"""A checkpoint's weights: safetensors files or a GGUF file, quantized at load when asked
(``weight_quantization``), and ``tollway convert`` (GGUF to a Hugging Face directory,
``gguf_convert``; either to a GGUF file, ``gguf_export``)."""
