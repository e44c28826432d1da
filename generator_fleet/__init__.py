"""The generator side: rollout workers that turn prompts into scored groups in the replay buffer
(`rollout.py`, `workflow.py`, `agent/`, `tools/`, `rewards.py`, `tasks/`), the built-in SGLang-compatible
engine (`engine/`), the HTTP client every engine is talked to through (`client.py`), SGLang launching
(`launch.py`), held-out evaluation (`evaluation.py`) and the `generators` / `rollout` spec sections
(`config.py`).

May import: common, models, replay_buffer, weight_bus (the engines' side of the weight routes). Never the
trainer.
"""
