"""Random-weight demo checkpoints in exact Hugging Face format (``tollway demo-model``)."""
