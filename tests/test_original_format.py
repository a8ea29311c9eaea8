"""Golden replies of the original llm-serving API: the bytes its examples/server_app_post.py writes
for the same tokens (key order, spacing, non-ASCII kept, newline-terminated, `data` as a one-element
list), written out by hand here rather than derived from our builders."""
from __future__ import annotations

from server import original_format as orig

A = orig.token_item(5, -0.5, False, "é")
B = orig.token_item(2, -1.25, True, "")
A_JSON = '{"id": 5, "logprob": -0.5, "special": false, "text": "é"}'
B_JSON = '{"id": 2, "logprob": -1.25, "special": true, "text": ""}'


def test_generate_reply_bytes():
    got = orig.line(orig.full_reply([A, B], "é", "stop"))
    assert got == ('{"generated_text": "é", "finish_reason": "stop", "generated_tokens": 2, '
                   f'"prefill": [{A_JSON}], "seed": 0, "tokens": [{A_JSON}, {B_JSON}], '
                   f'"top_tokens": [[{A_JSON}]], "details": null}}\n')


def test_sse_stream_lines_bytes():
    assert orig.line(orig.event(orig.stream_item(A))) == (
        '{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": "é", '
        f'"tokens": {A_JSON}, "top_tokens": [{A_JSON}]}}]}}\n')
    final = orig.line(orig.event(orig.final_item([A, B], "é", "length")))
    assert final == ('{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": "é", '
                     f'"finish_reason": "length", "generated_tokens": 2, "prefill": [{A_JSON}], "seed": 0, '
                     f'"tokens": [{A_JSON}, {B_JSON}], "top_tokens": [[{A_JSON}]]}}]}}\n')


def test_plain_protocol_stream_lines_bytes():
    assert orig.plain_line(orig.stream_item(A)) == (
        f'data:{{"details": null, "generated_text": "é", "tokens": {A_JSON}, "top_tokens": [{A_JSON}]}}\n')
    assert orig.plain_line(orig.full_reply([A], "é", "cancelled")).startswith(
        'data:{"generated_text": "é", "finish_reason": "abort", "generated_tokens": 1,')


def test_status_events_bytes():
    assert orig.status_event(3) == 'data: {"event": "message", "retry": 30000, "data": 3}\r\n\r\n'


def test_finish_reasons_are_the_originals():
    assert {orig.FINISH_REASON[r] for r in ("stop", "length", "cancelled", "error")} == {"stop", "length", "abort"}
