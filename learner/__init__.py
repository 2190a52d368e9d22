"""The learning side: losses and advantages (pure tensor functions), and later the DeepSpeed
learner, weight publishing and checkpoints."""
