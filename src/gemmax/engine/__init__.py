"""The engine: device policy, memory plan, shape planning, the jitted steps, the scheduler that batches
requests over them, sampling, warm-up and the compile cache."""
