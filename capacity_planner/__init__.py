"""``tollway plan``: how many GPUs a traffic needs, and what they cost. An offline tool.

The plan is pure: `capacity_plan` over `plan_inputs`, one module a concern, each returning its
figures with their `plan_step`s: the memory arithmetic in `kv_memory`, the traffic at the peak
in `peak_traffic`, the GPUs in `fleet_size` (the per-GPU rate and tensor-parallel degree in
`gpu_rate`, over the decode `roofline`), the prefill in `prefill_load` and the cost in
`fleet_cost`; a GPU from `gpu_presets` and a model's shape from `model_shape`. Its two measured
inputs read the gateway's usage records (`usage_traffic`) or load a running engine
(`engine_measurement`). The command is `capacity_planner.cli`; `options` turns its options
into `PlanInputs` and `report` prints the plan.
"""
