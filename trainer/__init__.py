"""The trainer side: one rank's models and optimizer steps (`learner.py`: losses, packing, FSDP2 in
`distributed.py`, the memory plan in `memory.py`), the step loop that reads the replay buffer and
publishes over the weight bus (`trainer.py`), checkpoints (`checkpoint.py`) and the `trainer` /
`algorithm` spec sections (`config.py`).

May import: common, models, replay_buffer, weight_bus. Never the generator fleet.
"""
