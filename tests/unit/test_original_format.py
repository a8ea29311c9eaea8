"""Golden replies of the original llm-serving API: the bytes its examples/server_app_post.py writes
for the same tokens (key order, spacing, non-ASCII kept, newline-terminated, `data` as a one-element
list), written out by hand here rather than derived from our builders."""
from __future__ import annotations

import pytest

from server.http import original_format as orig

A = orig.token_item(5, -0.5, False, "é")
B = orig.token_item(2, -1.25, True, "")
A_JSON = '{"id": 5, "logprob": -0.5, "special": false, "text": "é"}'
B_JSON = '{"id": 2, "logprob": -1.25, "special": true, "text": ""}'


FULL = f'"prefill": [{A_JSON}], "seed": 0, "tokens": [{A_JSON}, {B_JSON}], "top_tokens": [[{A_JSON}]]'
TOKEN_LINE = ('{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": "é", '
              f'"tokens": {A_JSON}, "top_tokens": [{A_JSON}]}}]}}\n')


def test_generate_reply_bytes():
    got = orig.line(orig.full_reply([A, B], "é", "eos"))
    assert got == ('{"generated_text": "é", "finish_reason": "eos", "generated_tokens": 2, '
                   f'{FULL}, "details": null}}\n')


def test_sse_stream_lines_bytes():
    assert orig.line(orig.event(orig.stream_item(A))) == TOKEN_LINE
    final = orig.line(orig.event(orig.final_item([A, B], "é", "length")))
    assert final == ('{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": "é", '
                     f'"finish_reason": "length", "generated_tokens": 2, {FULL}}}]}}\n')


def test_plain_protocol_stream_lines_bytes():
    assert orig.plain_line(orig.stream_item(A)) == (
        f'data:{{"details": null, "generated_text": "é", "tokens": {A_JSON}, "top_tokens": [{A_JSON}]}}\n')
    assert orig.plain_line(orig.full_reply([A], "é", "cancelled")).startswith(
        'data:{"generated_text": "é", "finish_reason": "abort", "generated_tokens": 1,')


def test_status_events_bytes():
    assert orig.status_event(3) == 'data: {"event": "message", "retry": 30000, "data": 3}\r\n\r\n'


def test_finish_reasons_are_the_originals():
    """generate_result's reasons: eos (an end token), length, predict_failed (the agent failed)."""
    assert {r: orig.FINISH_REASON[r] for r in ("eos", "length", "error")} == {
        "eos": "eos", "length": "length", "error": "predict_failed"}


@pytest.mark.parametrize("reason, said", [("eos", "eos"), ("length", "length"), ("stop", "stop")])
def test_stream_endings_with_return_full_text(reason, said):
    """The default (return_full_text on): token lines, then the whole generated text with the reason."""
    out = orig.StreamLines(sse=True, full_text=True)
    assert out.token(A) == TOKEN_LINE
    out.token(B)
    assert out.end(reason) == ('{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": '
                               f'"é", "finish_reason": "{said}", "generated_tokens": 2, {FULL}}}]}}\n')
    plain = orig.StreamLines(sse=False, full_text=True)
    plain.token(A)
    plain.token(B)
    assert plain.end(reason) == (f'data:{{"generated_text": "é", "finish_reason": "{said}", "generated_tokens": 2, '
                                 f'{FULL}, "details": null}}\n')


@pytest.mark.parametrize("reason", ["eos", "length", "stop"])
def test_stream_endings_without_return_full_text(reason):
    out = orig.StreamLines(sse=True, full_text=False)
    assert out.token(A) == TOKEN_LINE and out.end(reason) is None  # the token lines are the whole answer


def test_stream_failure_endings():
    """An agent failure mid-stream: predict_failed, with our reason beside it."""
    out = orig.StreamLines(sse=True, full_text=True)
    out.token(A)
    out.token(B)
    assert out.end("error", "agent died") == (
        '{"event": "message", "retry": 30000, "data": [{"details": null, "generated_text": "é", '
        f'"finish_reason": "predict_failed", "generated_tokens": 2, {FULL}, "error": "agent died"}}]}}\n')
    bare = orig.StreamLines(sse=True, full_text=False)
    bare.token(A)
    assert bare.end("error", "agent died") == (
        '{"event": "error", "data": [{"error": "agent died", "finish_reason": "predict_failed", '
        '"generated_text": ""}]}\n')


def _precision_folder(folder, files: dict[str, list[float]]) -> None:
    import numpy as np

    folder.mkdir()
    for name, values in files.items():
        np.save(folder / name, np.asarray(values, np.float32))


def test_precision_compare_reads_the_contests_own_naming(tmp_path, capsys):
    """A baseline folder named as the contest's agent named its files ({time.time()}_{first 20
    characters of the ids as floats}_{absolute position}.npy; two prompts sharing their first ids
    share a key) pairs with ours by request and position, whatever the times."""
    from agent.logits_dump import ids_key
    from tools.precision import compare

    a, b = ids_key([1, 20355, 915, 278, 5]), ids_key([1, 20355, 915, 278, 7])
    assert a == b == "1.020355.0915.0278.0"  # the contest's example name
    c = ids_key([3])
    baseline = {f"1718418290.5565388_{a}_100.npy": [1.0, 2.0], f"1718418291.25_{a}_200.npy": [3.0, 4.0],
                f"1718418295.5_{a}_100.npy": [5.0, 6.0], f"1718418299.0_{c}_100.npy": [7.0, 8.0]}
    ours = {f"1790000000.1_{a}_100.npy": [1.0, 2.001], f"1790000000.2_{a}_200.npy": [3.0, 4.0],
            f"1790000003.3_{a}_100.npy": [5.0, 6.0], f"1790000004.4_{c}_100.npy": [7.0, 8.0]}
    _precision_folder(tmp_path / "base", baseline)
    _precision_folder(tmp_path / "ours", ours)
    assert compare(tmp_path / "base", tmp_path / "ours")
    assert capsys.readouterr().out.count("ok  ") == 4
    ours["1790000003.3_" + a + "_100.npy"] = [5.0, 6.5]  # the second request with key `a`: paired by order
    _precision_folder(tmp_path / "off", ours)
    assert not compare(tmp_path / "base", tmp_path / "off")
    assert f"first difference: 1718418295.5_{a}_100.npy (position 100)" in capsys.readouterr().out


def test_precision_compare_pairs_our_earlier_naming_and_refuses_strangers(tmp_path):
    import pytest

    from tools.precision import compare

    _precision_folder(tmp_path / "x", {"20261126101010000000001_req3_pos0.npy": [1.0],
                                       "20261126101010000000002_req3_pos100.npy": [2.0]})
    _precision_folder(tmp_path / "y", {"20261127101010000000001_req9_pos0.npy": [1.0],
                                       "20261127101010000000002_req9_pos100.npy": [2.0]})
    with pytest.raises(SystemExit, match="unpaired"):  # other request keys: not the same run
        compare(tmp_path / "x", tmp_path / "y")
    _precision_folder(tmp_path / "z", {"notes.npy": [1.0]})
    with pytest.raises(SystemExit, match="notes.npy: not a precision file"):
        compare(tmp_path / "x", tmp_path / "z")
