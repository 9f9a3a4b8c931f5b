"""Chat input as vLLM's ``LLM.chat`` takes it, on text models: prompt ids equal
``tokenizer.apply_chat_template`` for every form (string / list / ``None`` content, system
messages, ``add_generation_prompt``, ``continue_final_message``, ``chat_template`` override,
``chat_template_kwargs``) on the embedded SmolLM2 tokenizer and the Qwen tokenizer; issue 7
examples 4 (list content) and 5 (assistant prefill); nothing silently ignored."""

from __future__ import annotations

import pytest

from atlas_vlm import LLM, SamplingParams

pytestmark = pytest.mark.text

IM_END = {"smollm2": 2}
CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}|{{ greeting | default('none') }}]{{ m['content'] }}"
                   "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def engines(tiny_models):
    """The embedded SmolLM2 (GGUF) and a tiny Qwen2 with the real Qwen tokenizer."""
    return {"smollm2": LLM(max_model_len=256, kv_cache_memory=32 << 20, dtype="float32"),
            "qwen": LLM(str(tiny_models["qwen2"][0]), max_model_len=256, num_kvcache_blocks=64, dtype="float32")}


# (our prompt dict, the string-content messages HF renders, apply_chat_template kwargs)
FORMS = {
    "string": ({"messages": [{"role": "user", "content": "Hi there"}]},
               [{"role": "user", "content": "Hi there"}], {"add_generation_prompt": True}),
    "system": ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
               [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
               {"add_generation_prompt": True}),
    "list": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                        {"type": "text", "text": "How are you?"}]}]},
             [{"role": "user", "content": "Hi\nHow are you?"}], {"add_generation_prompt": True}),
    "none_content": ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                                   {"role": "user", "content": "Again"}]},
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                      {"role": "user", "content": "Again"}], {"add_generation_prompt": True}),
    "no_generation_prompt": ({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
                             [{"role": "user", "content": "Hi"}], {"add_generation_prompt": False}),
    "continue_final": ({"messages": [{"role": "user", "content": "What is the capital of France?"},
                                     {"role": "assistant", "content": [{"type": "text", "text": "The capital"},
                                                                       {"type": "text", "text": "of France is"}]}],
                        "add_generation_prompt": False, "continue_final_message": True},
                       [{"role": "user", "content": "What is the capital of France?"},
                        {"role": "assistant", "content": "The capital\nof France is"}],
                       {"add_generation_prompt": False, "continue_final_message": True}),
    "template_override": ({"messages": [{"role": "user", "content": "Hi"}], "chat_template": CUSTOM_TEMPLATE},
                          [{"role": "user", "content": "Hi"}],
                          {"add_generation_prompt": True, "chat_template": CUSTOM_TEMPLATE}),
    "template_kwargs": ({"messages": [{"role": "user", "content": "Hi"}], "chat_template": CUSTOM_TEMPLATE,
                         "chat_template_kwargs": {"greeting": "hello"}},
                        [{"role": "user", "content": "Hi"}],
                        {"add_generation_prompt": True, "chat_template": CUSTOM_TEMPLATE, "greeting": "hello"}),
}


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_prompt_ids_equal_apply_chat_template(engines, model, form):
    llm = engines[model]
    prompt, hf_messages, kwargs = FORMS[form]
    ids = llm.engine.process_prompt(prompt).prompt_token_ids
    ref = llm.tokenizer.apply_chat_template(hf_messages, tokenize=True, return_dict=False, **kwargs)
    assert ids == list(ref)
    if form == "continue_final":  # the prefill is the end of the prompt: no end-of-turn after it
        tail = llm.tokenizer("of France is", add_special_tokens=False)["input_ids"]
        assert ids[-len(tail):] == tail
    if form == "template_kwargs":
        assert "[user|hello]Hi[assistant]" == llm.tokenizer.decode(ids)


def test_qwen_template_variable_enable_thinking(engines):
    """A variable of the model's own template (Qwen3's ``enable_thinking``) reaches it."""
    tok = engines["qwen"].tokenizer
    messages = [{"role": "user", "content": "Hi"}]
    ids = engines["qwen"].engine.process_prompt({"messages": messages,
                                                 "chat_template_kwargs": {"enable_thinking": False}}).prompt_token_ids
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True, enable_thinking=False)
    assert ids != engines["qwen"].engine.process_prompt({"messages": messages}).prompt_token_ids


def test_issue_example_4_list_content_on_a_text_model(engines):
    llm = engines["smollm2"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    (as_list,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], greedy, use_tqdm=False)
    (as_str,) = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)
    assert as_list.prompt_token_ids == as_str.prompt_token_ids
    assert as_list.token_ids == as_str.token_ids and len(as_list.token_ids) > 0
    (after_none,) = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                              {"role": "user", "content": "Hi"}], greedy, use_tqdm=False)
    assert after_none.finish_reason in ("stop", "length")


def test_issue_example_5_assistant_prefill_is_continued(engines):
    llm = engines["smollm2"]
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), add_generation_prompt=False,
                      continue_final_message=True, use_tqdm=False)
    prefill = llm.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids[-len(prefill):] == prefill  # not closed by <|im_end|> (id 2)
    assert out.prompt_token_ids.count(IM_END["smollm2"]) == 2  # system and user turns only
    assert out.text.startswith(" Paris")
    (closed,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), add_generation_prompt=False,
                         use_tqdm=False)
    assert closed.prompt_token_ids[-2:] == [IM_END["smollm2"], llm.tokenizer("\n")["input_ids"][0]]


@pytest.mark.parametrize(("prompt", "cause"), [
    ({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
      "continue_final_message": True}, "cannot both be True"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "content type 'input_audio' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]},
     "video items need a vision-language model"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "fsp": 2}]}]},
     r"unknown key\(s\) \['fsp'\] in a 'video' item"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "lang": "en"}]}]},
     r"unknown key\(s\) \['lang'\] in a 'text' item"),
    ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}, r"unknown key\(s\) \['temperature'\]"),
    ({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenize": False}},
     r"may not set \['tokenize'\]"),
    ({"messages": [{"role": "narrator", "content": "Hi"}]}, "role 'narrator' is not one of"),
    ({"messages": [{"role": "user", "content": "Hi", "mood": "happy"}]}, r"unknown key\(s\) \['mood'\]"),
    ({"messages": [{"role": "user", "content": "Hi"}], "mm_options": {"max_pixel": 100}},
     r"unknown option\(s\) \['max_pixel'\]"),
    ({"prompt": "Hi", "suffix": "!"}, r"unknown key\(s\) \['suffix'\] in a 'prompt' prompt dict"),
    ({"prompt": "Hi", "mm_options": {"max_pixels": 784}}, "mm_options applies to chat prompts"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}],
      "add_generation_prompt": False, "continue_final_message": True}, "needs text in the last message"),
])
def test_nothing_silently_ignored(engines, prompt, cause):
    llm = engines["smollm2"]
    with pytest.raises(ValueError, match=cause):
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.requests and llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_wrong_types_named(engines):
    llm = engines["smollm2"]
    with pytest.raises(TypeError, match="continue_final_message must be a bool"):
        llm.engine.process_prompt({"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": "yes"})
    with pytest.raises(TypeError, match=r"messages\[0\].content must be a str, a list of items or None"):
        llm.engine.process_prompt({"messages": [{"role": "user", "content": 5}]})
