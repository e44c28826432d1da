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
