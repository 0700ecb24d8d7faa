"""The text room: what goes in and out as text.

`inputs.py` (prompts and parameters as the public API takes them -> token ids), `tokenizer.py`
(tokenizers + chat template), `detokenizer.py` (incremental, never splits a character),
`stop_checker.py` (stop strings across token boundaries), `output_processor.py` (append a
token, stop conditions, RequestOutput).
"""
