"""With no model named, `deepinfer generate`, `deepinfer serve` and `EngineConfig()` run the embedded stdlib-coder;
a named model still wins, and a mistyped model path is an error, never silently sent as a prompt."""

from __future__ import annotations

import ast
import json
import os
import signal

from test_cli_commands import assert_user_error, deepinfer, start_serve

from deepinfer import EngineConfig, embedded_model_path

# a held-out stdlib function (Lib/mailbox.py is in the held-out split), signature + docstring
PROMPT = 'def _pre_mailbox_hook(self, f):\n    """Called before writing the mailbox to file f."""'


def _greedy(prompt: str, max_tokens: int):
    from deepinfer import DeepInferenceEngine, SamplingParams

    engine = DeepInferenceEngine(EngineConfig(load_progress=False))
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]


def _body(text: str) -> str:
    """The completion up to where the function body ends (the first non-blank line back at column 0)."""
    lines = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            break
        lines.append(line)
    return "".join(lines)


def test_engine_config_defaults_to_the_embedded_model():
    cfg = EngineConfig()
    assert cfg.model_name_or_path == embedded_model_path()
    assert os.path.isfile(os.path.join(cfg.model_name_or_path, "model.safetensors"))
    assert EngineConfig("/some/model").model_name_or_path == "/some/model"


def test_generate_without_a_model_runs_the_embedded_one():
    out = deepinfer("generate", "def fib(n):", "--temperature", "0", "--max-tokens", "12", "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "loaded stdlib-coder on backend cpu" in out.stderr
    got = json.loads(out.stdout)
    ref = _greedy("def fib(n):", 12)
    assert got["prompt_token_ids"] == list(ref.prompt_token_ids)
    assert got["outputs"][0]["token_ids"] == list(ref.outputs[0].token_ids)


def test_a_named_model_wins_and_a_missing_one_is_an_error(tmp_path):
    assert_user_error(deepinfer("generate", "./no/such/model", "hi", "--no-progress"), "MODEL_PATH", "./no/such/model")
    # --model: every positional argument is a prompt, and the named directory is the model
    out = deepinfer("generate", "--model", str(tmp_path), "hello", "--no-progress")
    assert_user_error(out, str(tmp_path))
    assert_user_error(deepinfer("serve", str(tmp_path), "--model", str(tmp_path), "--port", "0"), "given twice")


def test_serve_without_a_model_answers_the_openai_client_with_python():
    import openai

    proc, url, banner = start_serve("--port", "0", "--log-level", "warning")
    try:
        assert "as 'stdlib-coder'" in banner
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["stdlib-coder"]
        resp = client.completions.create(model="stdlib-coder", prompt=PROMPT, max_tokens=40, temperature=0)
        text = resp.choices[0].text
        assert text == _greedy(PROMPT, 40).outputs[0].text
        fn = ast.parse(PROMPT + _body(text)).body[0]
        assert isinstance(fn, ast.FunctionDef) and len(fn.body) >= 2, text  # a statement after the docstring
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
