"""What a model is to a job: the `model` spec section (`config.py`: path, dtype, LoRA), and tokenizers
loaded from a model directory or a GGUF file (`tokenizers.py`).

May import: common.
"""
