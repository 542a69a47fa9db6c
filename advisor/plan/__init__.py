"""The planner: how to train a model on given hardware, each candidate priced by memory and by step time."""
