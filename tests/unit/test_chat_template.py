"""`tokenizer.chat_template`: a template (or a file holding one) configured for a model replaces the
model's own; Gemma 3 270M's config gives its base GGUF Gemma's turns."""
from __future__ import annotations

from common.config import load_config
from common.model_files import ModelFiles
from common.tokenizer import load_tokenizer
from tests.helpers import ROOT

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def test_a_configured_template_or_its_file_replaces_the_models(tiny_model_dir, tmp_path):
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    for given in (TEMPLATE, str(tmp_path / "chat.jinja")):
        tok = load_tokenizer(ModelFiles("hf", tiny_model_dir), None, given)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], False) == "[user]hi"
    assert load_tokenizer(ModelFiles("hf", tiny_model_dir)).apply_chat_template(
        [{"role": "user", "content": "hi"}], False) == "<|im_start|>user\nhi<|im_end|>\n"  # the model's own


def test_gemma3_config_renders_gemma_turns(tiny_model_dir):
    cfg = load_config(ROOT / "configs" / "gemma3-270m.yaml")
    assert cfg.notices == []
    tok = load_tokenizer(ModelFiles("hf", tiny_model_dir), None, cfg.chat_template)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Paris?"}])
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nParis?<end_of_turn>\n<start_of_turn>model\n")
