"""tiktoken rank files shipped as package data (see README.md here for their source)."""
