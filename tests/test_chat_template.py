"""Where the chat template comes from: chat_template.jinja (transformers >= 4.43) or
tokenizer_config.json, else a logged fallback."""

import logging
import shutil

from tailserve.model.tokenizer import Tokenizer
from tailserve.server.chat import ChatTemplate


def test_chat_template_jinja_beside_the_tokenizer_is_used(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    tok = Tokenizer(ckpt)
    assert tok.chat_template.startswith("{% for m in messages %}<<")
    ids = ChatTemplate(tok).render([{"role": "user", "content": "hi"}])
    assert ids == tok.encode("<<hi>>", add_special_tokens=False)


def test_a_model_without_a_template_logs_the_fallback_once(llama_checkpoint, caplog):
    path, _ = llama_checkpoint
    tok = Tokenizer(path)
    assert tok.chat_template is None
    with caplog.at_level(logging.WARNING, logger="tailserve.server"):
        chat = ChatTemplate(tok)
        chat.render([{"role": "user", "content": "a"}])
        chat.render([{"role": "user", "content": "b"}])
    assert sum("no chat template" in r.message for r in caplog.records) == 1
    assert chat.render([{"role": "user", "content": "a"}]) == tok.encode("### User\na\n\n### Assistant\n")
