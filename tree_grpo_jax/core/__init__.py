"""The tree engine: static specs, sampling maths, the batched rollout, credit assignment,
pruning and the flat rows a step trains on."""
