"""Token ids to text: incremental detokenization, stop strings and the output processor."""
