"""What a model's files say, read without torch: the config, the tokenizer (with its chat
template), a GGUF file's metadata and vocabulary, and `Checkpoint`, the one place a
checkpoint path is opened.

Below both sides: the engine reads its model through it, the gateway counts tokens and reads
context windows with it, and the planner reads a model's shape. It imports neither of them.
"""
