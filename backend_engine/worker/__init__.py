"""What runs a step on the device: the model runner, the sampler, failure isolation and the
CPU runtime's tuning."""
