"""A training run: its assembly from a config, the trainer, the loop, the train step,
checkpoints, the run's identity and workdir, sharding and the fit check before a first
iteration."""
