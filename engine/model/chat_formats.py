"""Standard turn formats for GGUF files that carry no chat template.

A GGUF usually stores its model's Jinja template under
``tokenizer.chat_template``; some files (the Gemma 3 270M package among them)
do not. llama.cpp then falls back to the turn format of the model's family;
``standard_template`` does the same, as a Jinja template rendered by the one
chat-template path (``Tokenizer.apply_chat_template``), so a fallback behaves
like a file's own template (roles checked with ``raise_exception``, BOS
written by the template as Hugging Face's templates do).

=================  ==========================================================
architecture       format
=================  ==========================================================
gemma, gemma2/3    Gemma's ``<start_of_turn>user`` / ``model`` turns; a system
                   message is prepended to the first user turn (Gemma 3's own
                   template, as Hugging Face ships it)
qwen2, qwen3       ChatML (``<|im_start|>role ... <|im_end|>``)
phi3               ``<|user|> ... <|end|>`` turns
llama              Llama 3 header turns where the vocabulary has
                   ``<|start_header_id|>``, ChatML where it has
                   ``<|im_start|>``; otherwise none
=================  ==========================================================
"""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

CHATML = """{%- for message in messages -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}
"""

LLAMA3 = """{{ bos_token }}
{%- for message in messages -%}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif -%}
"""

PHI3 = """{%- for message in messages -%}
    {{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|assistant|>\n' }}
{%- endif -%}
"""

_BY_ARCHITECTURE = {"gemma": GEMMA, "gemma2": GEMMA, "gemma3": GEMMA,
                    "qwen2": CHATML, "qwen3": CHATML, "phi3": PHI3}


def standard_template(architecture: str | None, vocabulary: BackendTokenizer) -> str | None:
    """The turn format of ``architecture`` as a Jinja chat template, or None
    where kvd knows none (chat is then refused, completions still served).
    ``vocabulary`` tells a Llama 3 file from a ChatML-speaking ``llama`` one."""
    if architecture in _BY_ARCHITECTURE:
        return _BY_ARCHITECTURE[architecture]
    if architecture == "llama":
        if vocabulary.token_to_id("<|start_header_id|>") is not None:
            return LLAMA3
        if vocabulary.token_to_id("<|im_start|>") is not None:
            return CHATML
    return None
