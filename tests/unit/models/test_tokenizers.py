import subprocess
import sys

from model_zoo import tiny as tiny_model
from model_zoo.tiny_tools import build_tokenizer
from models.tokenizers import load_tokenizer


def test_char_level_tokenizer_keeps_whitespace_after_a_round_trip(tmp_path):
    tok = build_tokenizer()
    model = tiny_model.tiny_config(len(tok), hidden=32, layers=1, heads=2)  # model_type qwen2
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "3 apples\nand 4"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text


def test_a_generic_tokenizer_loads_without_torch(tmp_path):
    """A rollout worker of a tiny model needs the tokenizer only: loading it must not pull in torch, which
    AutoTokenizer's module imports (through transformers' model configuration)."""
    tok = build_tokenizer()
    tiny_model.tiny_config(len(tok), hidden=32, layers=1, heads=2).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    code = (
        "import sys\n"
        "import generator_fleet.rollout\n"
        "from models.tokenizers import load_tokenizer\n"
        f"tok = load_tokenizer({str(tmp_path)!r})\n"
        "assert tok.decode(tok.encode('3 apples')) == '3 apples'\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
