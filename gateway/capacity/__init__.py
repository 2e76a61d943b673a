"""Capacity planning (`tollway plan`): from users or requests to GPUs and cost.

Pure planning (`capacity_plan`, `roofline`) over a GPU (`gpu_presets`) and a model's shape
(`model_shape`); the two measured inputs read the gateway's usage records (`usage_traffic`)
or load a Tollway engine (`engine_measurement`). The command itself is
`gateway.launcher.plan_cli`.
"""
