"""The Qwen-style chat template written into the generated ``tokenizer_config.json``.

Written for this project. For system/user/assistant turns it renders the same prompt text as the
MiniCPM-o 4.5 template (ChatML framing, an empty ``<think>`` block when ``enable_thinking`` is false,
``<|tts_bos|>`` when ``use_tts_template`` is true, reasoning kept only after the last user query), so that
prompts built on the tiny checkpoint have the real token layout. The tool-description preamble is our own
wording: only the real model (which ships its own template) would be sensitive to it.
"""

from __future__ import annotations

CHAT_TEMPLATE = r"""
{%- set first_is_system = messages|length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nThe functions you may call are described inside <tools></tools>, one JSON signature per line:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call functions, reply with one JSON object per call, each inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{#- Position of the last genuine user query; a user turn that only wraps a tool response does not count. -#}
{%- set scan = namespace(found=false, last_query=messages|length - 1) -%}
{%- for back in range(messages|length - 1, -1, -1) -%}
    {%- set m = messages[back] -%}
    {%- if not scan.found and m.role == 'user' -%}
        {%- set wrapped = m.content is string and m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>') -%}
        {%- if not wrapped -%}
            {%- set scan.found = true -%}
            {%- set scan.last_query = back -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set body = m.content if m.content is not none else '' -%}
        {%- set thought = '' -%}
        {%- if m.reasoning_content is defined and m.reasoning_content is not none -%}
            {%- set thought = m.reasoning_content -%}
        {%- elif '</think>' in body -%}
            {%- set thought = body.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set body = body.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- if loop.index0 > scan.last_query and (loop.last or thought) -%}
            {{- '<|im_start|>assistant\n<think>\n' + thought.strip('\n') + '\n</think>\n\n' + body.lstrip('\n') -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' + body -}}
        {%- endif -%}
        {%- for call in (m.tool_calls or []) -%}
            {%- if not loop.first or body -%}{{- '\n' -}}{%- endif -%}
            {%- set fn = call.function if call.function else call -%}
            {%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + args + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
    {%- if use_tts_template is defined and use_tts_template is true -%}{{- '<|tts_bos|>' -}}{%- endif -%}
{%- endif -%}
""".strip()
