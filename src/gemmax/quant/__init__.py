"""Load-time quantisation: stored forms of a weight (int8, W4A16 with its Pallas kernel, 8/4-bit tables)
behind the one protocol `gemmax.model.linear` calls, the options, the device plan and the byte tables."""
