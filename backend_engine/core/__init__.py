"""The engine's torch-free core: the scheduler and its waiting queue, the KV cache manager and
block pool, requests and their stop rules, the step runner's interface and the prefix cache's
event log. Plain Python over token ids and block ids; the layer contracts in
``pyproject.toml`` hold it to importing no tensor library and nothing above it.
"""
